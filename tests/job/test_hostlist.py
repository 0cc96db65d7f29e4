"""expand_hostlist agrees with SLURM's hostlist syntax.

Proves: the documented examples expand as SLURM does (zero padding kept, commas inside brackets
not splitting hosts, several bracket groups per name); for random host specs rendered in hostlist
syntax, expansion equals the host list generated independently from the spec; malformed
hostlists raise ValueError naming the hostlist.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.job.hostlist import expand_hostlist


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("cpu3", ["cpu3"]),
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[007]", ["n007"]),
        ("a[1-2]b,c", ["a1b", "a2b", "c"]),
        ("[1-2]", ["1", "2"]),
        ("node-a.cluster,node-b.cluster", ["node-a.cluster", "node-b.cluster"]),
        (" gpu1 ", ["gpu1"]),
        ("", []),
    ],
)
def test_examples(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist",
    [
        "gpu[01-04",
        "gpu01]",
        "gpu[]",
        "gpu[1,]",
        "gpu[4-1]",
        "gpu[a-b]",
        "gpu[1-2-3]",
        "gpu[-3]",
        "gpu[1[2]]",
        "a,,b",
        "a,",
        "a b",
        "gpu[0-99999999]",
    ],
)
def test_malformed_raises_naming_the_hostlist(hostlist):
    with pytest.raises(ValueError, match="hostlist") as info:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(info.value)


# A spec is a list of hosts names; a name is literal text and bracket groups in turn; a group is
# items that are (lo, hi, width) ranges, hi == lo for a single number.
_literal = st.text("abcxyz-.", max_size=4)
_item = st.tuples(st.integers(0, 300), st.integers(0, 12), st.integers(1, 4)).map(
    lambda t: (t[0], t[0] + t[1], t[2])
)
_group = st.lists(_item, min_size=1, max_size=3)
_name = st.tuples(
    st.text("abcxyz", min_size=1, max_size=4), st.lists(st.tuples(_group, _literal), max_size=2)
)
_spec = st.lists(_name, min_size=1, max_size=4)


def _render(spec) -> str:
    def item(lo, hi, width):
        return f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}"

    def name(first, rest):
        return first + "".join(
            "[" + ",".join(item(*i) for i in group) + "]" + tail for group, tail in rest
        )

    return ",".join(name(*n) for n in spec)


def _hosts(spec) -> list[str]:
    """The spec's hosts, built by plain loops: no parsing involved."""
    hosts = []
    for first, rest in spec:
        names = [first]
        for group, tail in rest:
            numbers = [f"{n:0{width}d}" for lo, hi, width in group for n in range(lo, hi + 1)]
            names = [name + number + tail for name in names for number in numbers]
        hosts += names
    return hosts


@given(_spec)
def test_expansion_equals_independently_generated_hosts(spec):
    assert expand_hostlist(_render(spec)) == _hosts(spec)

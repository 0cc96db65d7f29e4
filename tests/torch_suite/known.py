"""What torch's DDP tests measured, and why each one torch passes fails under tandem.DDP.

Measured with ``python -m tests.torch_suite`` (torch 2.13.0 CPU, Gloo, world size 2) on the
tandem of commit bf78ff7, then again after the fixes of issue 25 (the 14 behaviour tests
and test_ddp_bucket_cap_mb_list, test_ddp_device_mesh_initialization moved to ``PASS_BOTH``);
docs/torch-ddp-suite.md has the table. ``test_torch_ddp_suite.py``
runs ``PASS_BOTH`` and ``BEHAVIOUR`` under tandem.DDP. When a change makes another test pass
under tandem, move it from ``TANDEM_FAILS`` to ``PASS_BOTH`` (the script's summary names
every test whose outcome is not explained here).
"""

from __future__ import annotations

# Pass with torch's DDP and with tandem.DDP: a regression fails test_torch_ddp_suite.py.
PASS_BOTH = (
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger",
    "test_ddp_broadcast_buffer",
    "test_ddp_broadcast_buffers_deprecation_warning",
    "test_ddp_bucket_cap_mb_list",
    "test_ddp_compile_static_graph",
    "test_ddp_create_graph",
    "test_ddp_device_mesh_initialization",
    "test_ddp_forward_backward_hook",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_hook_parity_allreduce",
    "test_ddp_hook_parity_allreduce_process_group",
    "test_ddp_hook_parity_post_localSGD",
    "test_ddp_hook_parity_powerSGD",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
    "test_ddp_join_model_equivalence",
    "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_model_diff_num_params_across_ranks",
    "test_ddp_namedtuple",
    "test_ddp_new_tensor_in_fwd",
    "test_ddp_new_tensor_in_fwd_static_graph",
    "test_ddp_returns_tensor_with_no_grad",
    "test_ddp_shared_grad_acc_unused_params",
    "test_ddp_static_graph_nested_types",
    "test_ddp_uneven_input_exception",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_zero_output_features",
    "test_DistributedDataParallel_requires_grad",
    "test_DistributedDataParallel_with_amp_and_grad_is_view",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_grads_same_across_ranks_with_no_sync",
    "test_output_unused_in_loss_dict_module",
    "test_output_unused_in_loss_tuple_module",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_grad_is_view",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    "test_post_localSGD_optimizer_step_reload",
    "test_skip_all_reduce_unused_parameters",
    "test_stateless_api_with_ddp",
    "test_static_graph_multi_forward",
    "test_undefined_grad_parity_unused_parameters",
    "test_verify_model_across_rank_with_logger",
    "test_verify_model_across_rank_without_logger",
)

PRIVATE = "torch-private internals"
ERROR = "torch's exact error"
BEHAVIOUR_GROUP = "behaviour"

# Pass with torch's DDP, fail with tandem.DDP: group and the reason, in one line.
TANDEM_FAILS: dict[str, tuple[str, str]] = {
    # Behaviour: what tandem.DDP should do as torch's does (issue 25's 14).
    # torch's own API beyond what a training script uses.
    "test_ddp_broadcast_buffer_via_hook": (PRIVATE, "DDP._register_buffer_comm_hook"),
    "test_ddp_buffer_hook_allreduce": (PRIVATE, "DDP._register_buffer_comm_hook"),
    "test_ddp_buffer_hook_allreduce_return_future": (PRIVATE, "DDP._register_buffer_comm_hook"),
    "test_ddp_build_debug_param_to_name_mapping": (
        PRIVATE,
        "DDP._build_params_for_reducer, DDP._build_debug_param_to_name_mapping",
    ),
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": (
        PRIVATE,
        "DDP._build_params_for_reducer, DDP._build_debug_param_to_name_mapping",
    ),
    "test_ddp_comm_hook_logging": (
        PRIVATE,
        "DDP._get_ddp_logging_data (its comm_hook field), DDP._register_builtin_comm_hook",
    ),
    "test_ddp_control_flow_different_across_ranks": (
        PRIVATE,
        "model.reducer._get_local_used_map, DDP._get_ddp_logging_data",
    ),
    "test_ddp_control_flow_same_across_ranks": (
        PRIVATE,
        "model.reducer._get_local_used_map, DDP._get_ddp_logging_data",
    ),
    "test_ddp_ignore_params_arg": (
        PRIVATE,
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
    ),
    "test_ddp_logging_data_cpu": (
        PRIVATE,
        "DDP._set_ddp_runtime_logging_sample_rate, DDP._get_ddp_logging_data",
    ),
    "test_ddp_multiple_nested_unused_params_err_ignore_params": (
        PRIVATE,
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
    ),
    "test_ddp_native_mixed_precision_ignored_params": (
        PRIVATE,
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, "
        "mixed_precision=_MixedPrecision(...)",
    ),
    "test_ddp_profiling_torch_profiler": (
        PRIVATE,
        "counts the profiler events of torch's C++ reducer (search_unused_parameters)",
    ),
    "test_ddp_remove_autograd_hooks": (PRIVATE, "DDP._remove_autograd_hooks"),
    "test_ddp_sink_noclone": (PRIVATE, "DDP._set_ddp_sink_clone"),
    "test_ddp_sync_module_states": (
        PRIVATE,
        "DDP.broadcast_bucket_size and DDP.parameters_to_ignore, for torch's _sync_module_states",
    ),
    "test_detect_ddp_is_actually_static": (PRIVATE, "model.reducer._ddp_graph_static"),
    "test_different_graph_across_ranks": (PRIVATE, "DDP._get_ddp_logging_data"),
    "test_get_data_parallel_params": (
        PRIVATE,
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, "
        "DDP._get_data_parallel_params",
    ),
    "test_static_graph_api_cpu": (PRIVATE, "DDP._set_static_graph"),
    # The test checks the exception torch raises for a misuse (its type and wording).
    "test_ddp_multiple_nested_unused_params_error": (
        ERROR,
        "an unused parameter: tandem raises UnusedParametersError (not a RuntimeError) on "
        "every rank; the test catches RuntimeError and reads torch's wording in it",
    ),
    "test_ddp_unused_params_rebuild_buckets_exception": (
        ERROR,
        "an unused parameter found on the second iteration: UnusedParametersError, not torch's "
        "RuntimeError 'Expected to have finished reduction...' (then that text in "
        "_get_ddp_logging_data)",
    ),
    "test_ddp_python_error_logged": (
        ERROR,
        "register_comm_hook({}, {}): tandem raises ValueError 'not callable', the test wants "
        "TypeError 'must be callable' (then _get_ddp_logging_data)",
    ),
    "test_invalid_static_graph": (
        ERROR,
        "static_graph=True with a graph that changes: the test wants torch's RuntimeError "
        "'Your training graph has changed'; tandem.DDP raises nothing",
    ),
}

BEHAVIOUR = tuple(n for n, (group, _) in TANDEM_FAILS.items() if group == BEHAVIOUR_GROUP)

# Fail under both engines on a CPU machine: the GPU feature the test needs.
BOTH_FAIL = {
    "SyncBatchNorm": "SyncBatchNorm needs CUDA: torch's DDP refuses it on a CPU module",
    "apply_optim_in_backward": "torch's optimizer-in-backward hook waits on an accelerator stream",
    "native_mixed_precision": "DDP(mixed_precision=...) records CUDA events",
    "test_ddp_device": "checks output_device == rank (device_ids are dropped on the CPU)",
    "test_ddp_logging_data_gpu": "checks the CUDA device ids in the logging data",
    "sync_bn": "SyncBatchNorm needs CUDA",
}


def why_tandem_fails(name: str) -> str | None:
    """``"group: reason"`` for a test that passes with torch and fails with tandem, if known."""
    if name in TANDEM_FAILS:
        group, reason = TANDEM_FAILS[name]
        return f"{group}: {reason}"
    return None

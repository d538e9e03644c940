# ruff: noqa: E501  (a table of test names, one per line)
"""Which end-to-end tests ``make test`` (and so CI) leaves to ``make test-extended``.

CI has 90 minutes on a busy 2-core machine; the whole suite took 79 of them at stop 43 before the
benchmark smoke runs even started. So ``make test`` runs every quick test and a *core* of the slow
end-to-end tests -- at least one real-process test of every feature -- and the tests named here,
each a variant whose feature a core test already exercises against the real thing, carry the
``extended`` marker: ``make test-extended`` runs them (by hand before a stop; ``make test-all``
runs both). Each entry names the core test (or tests) that covers its feature in ``make test``.

A name here that no longer matches a test fails ``tests/structure/test_tiers.py``: a renamed test must not
silently move back into CI's share.
"""

from __future__ import annotations

EXTENDED: dict[str, str] = {
    # --- recovery of one failed rank: test_e2e_recovery's kill, hang, stall and second-failure tests
    "e2e/test_e2e_recovery.py::test_survivor_that_abandons_a_step_does_not_leave_peers_waiting": "killed_worker",
    "e2e/test_e2e_recovery.py::test_a_silent_worker_that_burns_cpu_is_excused_once_then_killed": "hung_worker",
    "e2e/test_e2e_recovery.py::test_a_stall_under_a_saturated_cpu_blames_only_the_stalled_rank": "stalled_worker",
    "e2e/test_e2e_recovery.py::test_rank0_exit_code_recovers": "killed_worker",
    "e2e/test_e2e_recovery.py::test_two_failures_at_once": "failure_during_recovery",
    "e2e/test_e2e_recovery.py::test_without_spares_a_cold_process_takes_the_rank": "killed_worker",
    "e2e/test_repeated_error_e2e.py::test_the_same_error_at_the_same_step_fails_the_job_after_three_generations": (
        "test_restart_budget_exhausted_fails_cleanly"
    ),
    "e2e/test_protocol_e2e.py::test_store_add_on_text_raises_in_the_caller_and_the_job_goes_on": "test_coordinator_ops (the refusal, unit)",
    # --- sharded jobs: fsdp2 kill+stuck, hsdp kill keeping groups, dp x tp, resharded resume,
    # live fsdp2 migration, hsdp shrink/grow, in-memory reshard without replicas
    "e2e/test_sharded_e2e.py::test_a_spare_that_warmed_up_while_it_waited_takes_a_rank_bitwise": "fsdp2_survives",
    "e2e/test_sharded_e2e.py::test_hsdp_survives_a_lost_node_from_peer_replicas_bitwise": (
        "test_an_hsdp_kill_keeps_the_survivors_groups + test_nodes_e2e node loss"
    ),
    "e2e/test_sharded_e2e.py::test_fsdp2_recovers_from_the_durable_tier_bitwise": "test_durable_e2e",
    "e2e/test_sharded_e2e.py::test_an_hsdp_migration_keeps_the_mesh_groups_it_did_not_touch_bitwise": (
        "test_an_fsdp2_rank_migrates_live_bitwise + test_an_hsdp_kill_keeps_the_survivors_groups"
    ),
    "e2e/test_sharded_e2e.py::test_fsdp2_over_tensor_parallel_resumes_on_a_smaller_mesh_resharded_bitwise": (
        "test_fsdp2_resumes_on_another_mesh_resharded_bitwise"
    ),
    "e2e/test_sharded_e2e.py::test_a_rank_renumbered_by_a_shrink_records_its_own_shards_after_the_grow": (
        "test_hsdp_shrinks_by_a_replica_group_and_grows_it_back"
    ),
    "e2e/test_sharded_e2e.py::test_hsdp_that_drops_its_shrunk_batch_trains_one_groups_shards_then_grows_back": (
        "test_elastic_e2e drop + hsdp shrink"
    ),
    # --- migration: migrate bitwise, leaver death, preemption notice drain
    "e2e/test_migration_e2e.py::test_joiner_death_mid_migration_aborts_and_training_goes_on": "leaver_death",
    "e2e/test_migration_e2e.py::test_status_and_drain_of_a_running_job": "test_migrate_a_rank_to_another_node",
    "e2e/test_migration_e2e.py::test_preemption_without_time_to_drain_recovers_elsewhere": "preemption_notice",
    "agent/test_notice.py::test_http_notice_drains_the_node": "test_preemption_notice + test_poller_against_a_real_http_server",
    # --- the durable tier: total loss, corrupt latest, wrong world size
    "e2e/test_durable_e2e.py::test_persist_command_and_sigterm_make_the_committed_step_durable": "total_loss",
    "e2e/test_durable_e2e.py::test_rank_memory_lost_recovers_from_the_durable_tier": "corrupt_latest",
    "e2e/test_durable_e2e.py::test_lost_memory_without_a_durable_checkpoint_fails_the_job_clearly": "wrong_world_size",
    # --- nodes: node loss from a peer replica, quarantine
    "e2e/test_nodes_e2e.py::test_the_last_node_is_never_quarantined": "quarantined",
    "e2e/test_nodes_e2e.py::test_a_node_and_its_replica_holder_lost_recover_from_durable": "node_loss + total_loss",
    "e2e/test_nodecopy_e2e.py::test_a_lost_node_recovers_from_replicas_sent_once_per_node_bitwise": (
        "test_a_killed_rank_recovers_from_its_split_snapshot_bitwise + node_loss"
    ),
    # --- elastic and survivors-first: shrink/grow every sample once, a kill dropped at once, a second
    # failure while the spare restores
    "e2e/test_elastic_e2e.py::test_waits_for_a_spare_then_replaces_bitwise": "shrink_then_grow",
    "e2e/test_elastic_e2e.py::test_drop_shrink_skips_the_lost_share_then_grows_back": "shrink_then_grow",
    "e2e/test_elastic_e2e.py::test_shrink_renumbers_the_ranks_after_the_lost_one": "shrink_then_grow",
    "e2e/test_survivors_e2e.py::test_a_hung_rank_is_dropped_at_once_and_its_spare_joins_by_a_grow_bitwise": (
        "the killed-rank twin"
    ),
    "e2e/test_survivors_e2e.py::test_a_lost_node_shrinks_at_once_then_grows_with_the_spare_left": "the killed-rank twin",
    "e2e/test_survivors_e2e.py::test_a_spare_that_dies_while_it_prepares_is_replaced_and_the_grow_retried": (
        "test_a_second_failure_while_the_spare_restores_and_a_failure_of_the_spare"
    ),
    # --- rescues and the tuned interval: a killed rank rescued, a budget's kill rescued
    "e2e/test_rescue_e2e.py::test_a_hung_rank_is_dropped_and_the_survivors_keep_their_step": "the killed-rank twin",
    "e2e/test_rescue_e2e.py::test_an_hsdp_rank_takes_the_rescued_shards_of_its_copy_in_the_other_replica_group": (
        "the killed-rank twin + test_rescue (copy groups)"
    ),
    "policy/test_cadence.py::test_ranks_seeded_apart_keep_the_interval_and_the_job_says_why": "budget_widens (+ unit)",
    "snapshot/test_snapshot_every.py::test_without_rescues_a_kill_goes_back_to_the_last_snapshot": "failures_and_a_migration",
    # --- the control store: a coordinator restart on etcd
    "e2e/test_coordinator_restart.py::test_coordinator_restart_mid_migration_ends_it_cleanly": "restart_on_etcd",
    "e2e/test_coordinator_restart.py::test_coordinator_restart_mid_grow_ends_it_and_the_job_grows_again": "restart_on_etcd",
    "e2e/test_coordinator_restart.py::test_a_restarted_coordinator_takes_up_the_tuned_interval_and_still_rescues": (
        "restart_on_etcd + test_cadence (unit)"
    ),
    "e2e/test_store_stall.py::test_a_store_stall_of_3s_fences_nothing_while_the_coordinator_hears_every_node": (
        "test_partitioned_minority_is_fenced"
    ),
    "control/test_etcd_tls.py::test_a_multi_node_job_runs_over_etcds": "test_etcd_tls's other tests (a real TLS etcd) + the channel TLS demo",
    # --- stragglers: a straggler migrated away
    "e2e/test_straggler_e2e.py::test_no_fault_flags_nothing": "test_straggler (pure policy)",
    "e2e/test_straggler_e2e.py::test_a_degraded_node_is_drained": "straggler_is_migrated",
    "e2e/test_straggler_e2e.py::test_a_whole_job_slowdown_and_a_one_off_slow_step_flag_nothing": "test_straggler (pure policy)",
    "e2e/test_straggler_e2e.py::test_a_failure_on_a_degraded_node_is_replaced_on_another_node": "straggler_is_migrated",
    "e2e/test_straggler_e2e.py::test_a_sharded_straggler_is_flagged_from_its_sampled_waits": "straggler_is_migrated",
    # --- memory pressure: memory fills mid-run
    "e2e/test_shm_degrade_e2e.py::test_a_kill_after_the_memory_degraded_still_recovers_bitwise": "memory_fills",
    "e2e/test_shm_degrade_e2e.py::test_with_one_copy_per_node_a_full_memory_tier_degrades_the_shared_slots_and_finishes_bitwise": (
        "memory_fills"
    ),
    # --- the ecosystem and operations: accelerate, torchrun's flags, a user script, export, metrics
    "structure/test_examples.py::test_the_loop_example_survives_a_kill_bitwise": "test_steps_e2e user-owned loop",
    "e2e/test_torchenv_e2e.py::test_every_worker_sees_torchruns_environment_on_two_nodes_through_a_kill": (
        "test_a_torchrun_script_runs_with_torchruns_flags"
    ),
    "e2e/test_export_e2e.py::test_an_fsdp2_job_exports_its_shards_gathered_into_full_weights": "the data-parallel twin",
    "e2e/test_health_cmd_e2e.py::test_a_passing_health_cmd_changes_nothing": "the failing twin",
    "e2e/test_event_hook_e2e.py::test_tensorboard_gets_the_jobs_failure_and_recovery": "test_metrics_e2e",
    "timeline/test_timeline.py::test_render_the_log_of_a_real_job": "test_trace_of_a_real_job_with_a_kill",
    "chaos/test_chaos.py::test_chaos_soak_of_12_faults_loses_nothing_and_leaves_nothing": (
        "every fault kind's core test; the soak runs by hand (nonstop chaos)"
    ),
}

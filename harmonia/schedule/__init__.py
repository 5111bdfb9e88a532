# Layouts and plans; pipeline schedules: action IR, stage graph, generators, lowering, validator, every
# rank's action list; data balancing and the stage work the schedules are ordered with.
from harmonia.schedule.actions import Action, Kind, StageRef, dump_csv, load_csv
from harmonia.schedule.costs import CostTable, PhaseCost
from harmonia.schedule.cp_shards import (CPShards, attention_unit_costs, block_costs, plan_cp_shards,
                                         uniform_shards, zigzag_shards)
from harmonia.schedule.dp_balance import DPAssignment, balance_dp
from harmonia.schedule.families import (build_1f1b, build_gpipe, build_interleaved_1f1b, build_schedule,
                                        build_zero_bubble)
from harmonia.schedule.graph import IterationSchedule, ModuleStages, StageGraph
from harmonia.schedule.lowering import lower, strip_communication
from harmonia.schedule.microbatching import assign_microbatches, balance_bins, light_ends, order_microbatches
from harmonia.schedule.rank_actions import plan_rank_actions
from harmonia.schedule.replay import makespan, replay
from harmonia.schedule.submicrobatch import SubMicrobatches, encoder_item_costs, plan_submicrobatches
from harmonia.schedule.validator import Checker, DryRun, done_key, dry_run, format_table, message, validate

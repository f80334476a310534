"""Cache flags shared by every command that builds an engine (`hybridcache generate | demo | up`,
`hybridcache serve ROLE`): the prefix page tree's linear-state policy and its parameters, the
segment-entry policy, and whether the live pass runs from CUDA graphs. `hybridcache up` forwards
them to the services it starts (`cache_flag_args`), and likewise the served engine's flags of
`add_engine_flags` (`engine_flag_args`).
"""

from __future__ import annotations

FLAGS = (
    "prefix_policy",
    "entry_policy",
    "checkpoint_every",
    "anchors_per_page",
    "replay_anchors",
    "anchor_dtype",
    "host_cache_bytes",
    "entry_state_dtype",
    "cuda_graphs",
)


def add_prefix_cache_flags(sp) -> None:
    """Prefix page-tree flags (shared by every command that builds an engine)."""
    from hybridcache.services.runtime.cache import ENTRY_STATE_DTYPES, POLICIES

    sp.add_argument("--prefix-policy", default="exact_replay", choices=list(POLICIES),
                    help="how prefix pages keep the linear layers' state")
    sp.add_argument("--entry-policy", default="exact", choices=["exact", "single_state"],
                    help="segment entries (pic): exact composition T S + S, or single_state (a reused "
                         "segment keeps only its own state)")
    sp.add_argument("--checkpoint-every", type=int, default=4,
                    help="pages (64 tokens) between dense linear-state checkpoints "
                         "(checkpoint, exact_replay)")
    sp.add_argument("--anchors-per-page", type=int, default=4,
                    help="suffix_replay: hidden states kept per page at each linear-group entry (r)")
    sp.add_argument("--replay-anchors", type=int, default=64,
                    help="suffix_replay: most anchors a hit replays per group (k)")
    sp.add_argument("--host-cache-bytes", type=int, default=0,
                    help="segment entries evicted from the device cache move to a host-memory tier of this "
                         "many bytes (pinned with CUDA) and are staged back layer by layer on a hit; 0 = off")
    sp.add_argument("--entry-state-dtype", default="float32", choices=list(ENTRY_STATE_DTYPES),
                    help="storage of the segment entries' linear-layer T and S; bfloat16 halves a "
                         "delta-rule entry (composition keeps its running state in fp32)")
    sp.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                    help="on CUDA, run the live pass of assembled prompts from CUDA graphs of their shapes "
                         "(off: every forward eagerly)")
    # Checked by EngineConfig (a bad value is one error line, exit 2), not by argparse choices.
    sp.add_argument("--anchor-dtype", default="model", metavar="{model,float8_e4m3fn}",
                    help="suffix_replay: anchor storage; float8_e4m3fn keeps fp8 values with a per-anchor "
                         "fp32 scale (about half the bytes of bf16 anchors)")


def prefix_cache_config(args) -> dict:
    """EngineConfig keyword arguments from add_prefix_cache_flags' flags."""
    return {
        "prefix_policy": args.prefix_policy,
        "checkpoint_every": args.checkpoint_every,
        "anchors_per_page": args.anchors_per_page,
        "replay_anchors": args.replay_anchors,
        "anchor_dtype": None if args.anchor_dtype == "model" else args.anchor_dtype,
        "entry_policy": args.entry_policy,
        "host_cache_bytes": args.host_cache_bytes,
        "entry_state_dtype": args.entry_state_dtype,
        "cuda_graphs": args.cuda_graphs == "on",
    }


def cache_flag_args(args) -> list[str]:
    """The command-line form of add_prefix_cache_flags' values (for child processes)."""
    out = []
    for name in FLAGS:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


# flag -> the roles of `hybridcache up` it is forwarded to (--device goes by services/devices.py)
ENGINE_FLAGS = {
    "dtype": ("combine", "scatter"),
    "mode": ("combine", "scatter"),
    "entry_cache_bytes": ("combine", "scatter"),
    "prefix_cache_bytes": ("combine", "scatter"),
    "max_model_len": ("router",),
}


def add_engine_flags(sp) -> None:
    """The served engine's device, dtype, mode, limits and cache budgets (`serve`, `up`)."""
    sp.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where combine and scatter workers run (router and cache tier stay on the CPU)")
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model weights and K/V")
    sp.add_argument("--mode", default="pic", choices=["full", "prefix", "pic", "naive"],
                    help="combine/scatter: what the engine caches (the router adopts the combine worker's)")
    sp.add_argument("--max-model-len", type=int, default=None,
                    help="router: longest prompt plus max_new_tokens accepted (default and ceiling: the "
                         "model's max_position_embeddings)")
    sp.add_argument("--entry-cache-bytes", type=int, default=None,
                    help="segment-entry cache budget (default: 1 GiB on the CPU; on CUDA a share of the device "
                         "memory free after the model loads, stated at start-up)")
    sp.add_argument("--prefix-cache-bytes", type=int, default=None,
                    help="prefix page-tree budget (default: as --entry-cache-bytes, a smaller share)")


def engine_flag_args(args, role: str) -> list[str]:
    """The command-line form of add_engine_flags' values that `role` takes (for child processes)."""
    out = []
    for name, roles in ENGINE_FLAGS.items():
        value = getattr(args, name, None)
        if role in roles and value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out

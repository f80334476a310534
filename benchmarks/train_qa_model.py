"""Train the shipped QA model (models/default): a BPE tokenizer fitted on generated text, then a small
Qwen3.5 model (transformers' Qwen3_5ForCausalLM, 8 layers, 3 linear : 1 full) on full prompts of
the multi-document QA task (services/runtime/qa_data.py).

    python benchmarks/train_qa_model.py --out models/default --time-budget 360     # GPU
    python benchmarks/train_qa_model.py --out /tmp/m --steps 20 --batch 2 --max-docs 8  # CPU smoke

Seeded: the tokenizer, the initial weights and the data stream depend on --seed only. With
--time-budget the learning-rate schedule follows elapsed time and training stops when it runs out
(the step count reached is logged); with --steps alone the schedule follows steps. The directory
written is Hugging Face format: config.json, model.safetensors (fp32), tokenizer.json,
generation_config.json, plus train_log.jsonl. Prints one JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]


def _import_from_checkout() -> None:
    """Run from a checkout without `pip install`: map `hybridcache.*` onto the repo's folders."""
    import importlib.util
    import os
    import types

    if importlib.util.find_spec("hybridcache") is None or os.environ.get("HYBRIDCACHE_FROM_CHECKOUT"):
        pkg = types.ModuleType("hybridcache")
        pkg.__path__ = []
        sys.modules["hybridcache"] = pkg
        for sub in ("kernels", "services"):
            spec = importlib.util.spec_from_file_location(
                f"hybridcache.{sub}", REPO / sub / "__init__.py", submodule_search_locations=[str(REPO / sub)]
            )
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"hybridcache.{sub}"] = mod
            spec.loader.exec_module(mod)


_import_from_checkout()

from hybridcache.services.runtime.qa_data import QAGenerator, answer_text, corpus_text  # noqa: E402
from hybridcache.services.runtime.tokenizer import SPECIAL_TOKENS  # noqa: E402

VOCAB_SIZE = 1024
MODEL_CONFIG = dict(
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)
ANSWER_WEIGHT = 4.0  # extra loss weight on answer tokens (the task signal; documents are mostly noise)


def model_config(hidden: int = 256, layers: int = 8, heads: int = 4) -> dict:
    """MODEL_CONFIG resized (for small CPU proxy runs): every 4th layer full attention, the rest
    Gated DeltaNet; head dims hidden // heads, half as many KV heads, MLP 1.5x hidden. The
    defaults give MODEL_CONFIG exactly."""
    if hidden % heads or heads < 2 or layers < 1:
        raise ValueError("need hidden divisible by heads, heads >= 2, layers >= 1")
    hd = hidden // heads
    return dict(
        MODEL_CONFIG,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hd,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=hd,
        linear_value_head_dim=hd,
    )


def train_tokenizer(n_prompts: int = 400, seed: int = 0) -> Tokenizer:
    """Byte-level BPE (any text encodes) with a small vocabulary fitted on training-split text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text(n_prompts, seed), trainer)
    return tok


def encode_prompt(tok: Tokenizer, examples) -> tuple[list[int], list[int]]:
    """Token ids of one training prompt (parts encoded one by one, as the engine does) and, per
    token, 1 where it is an answer token (loss on the token predicted at that position)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    ex0 = examples[0]
    ids = enc(ex0.system)
    for d in ex0.documents:
        ids += enc(d)
    is_answer = [0] * len(ids)
    for ex in examples:
        q = enc(ex.suffix)
        a = enc(answer_text(ex.answer))
        ids += q + a
        is_answer += [0] * len(q) + [1] * len(a)
    return ids, is_answer


def curriculum_docs(frac: float, ramp: float, min_docs: int, max_docs: int) -> tuple[int, int]:
    """Documents per training prompt at training progress `frac` (0..1): from 2-3 documents (the
    fewest a 2-hop question needs) up to [min_docs, max_docs] linearly over the first `ramp` of
    training, then the full range. Retrieval is learnt much sooner on short prompts (more, cheaper
    steps with the same answer signal)."""
    if ramp <= 0 or frac >= ramp:
        return min_docs, max_docs
    t = frac / ramp
    lo = min(2 + round(t * (min_docs - 2)), min_docs)
    hi = min(3 + round(t * (max_docs - 3)), max_docs)
    return lo, max(hi, lo)


def curriculum_filler(frac: float, ramp: tuple[float, float]) -> float:
    """Share of document filler kept at training progress `frac`: 0 before ramp[0], rising linearly
    to 1 at ramp[1]. Without filler a prompt of 8-16 documents is ~1k tokens of facts about many
    entities of each kind, so binding a question to its entity is all that lowers the answer loss
    (choosing any value of the right kind, a shortcut that plateaus, no longer pays) and steps are
    cheap; the filler then comes back so the model meets the evaluated document lengths."""
    lo, hi = ramp
    if frac >= hi:
        return 1.0
    if frac <= lo:
        return 0.0
    return (frac - lo) / (hi - lo)


class PromptStream(torch.utils.data.IterableDataset):
    """Endless training prompts; each DataLoader worker draws from its own seeded generator. The
    number of documents follows `curriculum_docs` at the progress the training loop publishes in
    the shared `progress` value (workers are forked and read it at every prompt)."""

    def __init__(
        self,
        tok_json: str,
        seed: int,
        min_docs: int,
        max_docs: int,
        questions: int,
        ramp: float = 0.0,
        filler_ramp: tuple[float, float] = (0.0, 0.0),
        distinct_initials: bool = False,
        short_names_until: float = 0.0,
    ):
        self.tok_json, self.seed, self.min_docs, self.max_docs, self.questions = (
            tok_json,
            seed,
            min_docs,
            max_docs,
            questions,
        )
        self.ramp = ramp
        self.filler_ramp = filler_ramp
        self.distinct_initials = distinct_initials
        self.short_names_until = short_names_until
        self.progress = torch.multiprocessing.Value("d", 0.0)
        # set by the training loop when an adaptive curriculum ends the short-name stage early
        self.short_names_done = torch.multiprocessing.Value("b", 0)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tok = Tokenizer.from_str(self.tok_json)
        gen = QAGenerator("train", self.seed * 1000 + wid, self.min_docs, self.max_docs)
        gen.distinct_initials = self.distinct_initials
        while True:
            frac = self.progress.value
            gen.short_names = frac < self.short_names_until and not self.short_names_done.value
            gen.min_docs, gen.max_docs = curriculum_docs(frac, self.ramp, self.min_docs, self.max_docs)
            gen.filler = curriculum_filler(frac, self.filler_ramp)
            yield encode_prompt(tok, gen.prompt(self.questions))


def collate(batch, pad_id: int):
    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    valid = torch.zeros((len(batch), n), dtype=torch.bool)
    ans = torch.zeros((len(batch), n), dtype=torch.bool)
    for i, (x, a) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        valid[i, : len(x)] = True
        ans[i, : len(x)] = torch.tensor(a, dtype=torch.bool)
    return ids, valid, ans


def build_model(seed: int, config: dict | None = None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in (config or MODEL_CONFIG).items() if k not in ("model_type", "architectures")}
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))


def long_memory_heads(model, memories: list[int]) -> list[tuple[torch.Tensor, int, float]]:
    """Give the last len(memories) heads of every Gated DeltaNet layer a fixed, data-independent
    decay: head h keeps 1 - 1/L of its state per token (memory L tokens; the delta rule's erasure
    stays learnt). In Qwen3.5's GDN the per-token log decay is -exp(A_log) * softplus(a_t + dt_bias),
    a_t = in_proj_a(x_t): a zero row of in_proj_a, dt_bias = 0 and A_log = log(-log(1 - 1/L) / log 2)
    make it log(1 - 1/L) for every token. Returns (tensor, head, value) for `pin_long_memory`, which
    restores them after every optimizer step (their gradients are dropped too): a model whose linear
    layers carry state across documents, as issue 7's `naive` check needs, still in the standard
    architecture (the decay is just weights)."""
    pins = []
    n = len(memories)
    for layer in model.model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        heads = gdn.A_log.numel()
        if n > heads:
            raise ValueError(f"--long-memory gives {n} heads, the layers have {heads}")
        for j, mem in enumerate(memories):
            h = heads - n + j
            g = math.log(1.0 - 1.0 / mem)
            a_log = math.log(-g / math.log(2.0))
            pins += [(gdn.A_log, h, a_log), (gdn.dt_bias, h, 0.0), (gdn.in_proj_a.weight, h, 0.0)]
    pin_long_memory(pins)
    return pins


def pin_long_memory(pins) -> None:
    with torch.no_grad():
        for t, h, v in pins:
            t[h] = v
            if t.grad is not None:
                t.grad[h] = 0


def gdn_kernel(use_fla: bool) -> str:
    """Which gated-delta-rule kernel transformers will run. transformers takes fla's whenever fla is
    importable. Without --fla, fla is hidden (before transformers is imported) and the pure-torch
    chunked fallback trains. With --fla where fla-core refuses one step of its gated backward
    (Hopper with Triton >= 3.4 and < 3.7.1, fla #640), that step runs in PyTorch
    (kernels/ops/gated_delta_rule/bwd_dqkwg.py, checked against autograd): "fla+torch-dqkwg"."""
    import importlib.util

    if not use_fla:
        sys.modules["fla"] = None
        return "torch"
    if importlib.util.find_spec("fla") is None:
        return "torch"
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        from hybridcache.kernels.ops.gated_delta_rule.bwd_dqkwg import install_for_fla

        install_for_fla()
        return "fla+torch-dqkwg"
    return "fla"


def set_gdn_chunk(chunk_size: int) -> None:
    """Chunk length of transformers' pure-torch chunked gated delta rule (its default is 64). The
    inter-chunk scan is a Python loop of small launches, so longer chunks mean fewer launches per
    layer (the result is the same up to fp32 rounding; tests/benchmarks/test_train_script.py checks outputs
    and gradients). Applies to the fallback only, not to fla's kernels."""
    import functools

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    base = getattr(mq.torch_chunk_gated_delta_rule, "func", mq.torch_chunk_gated_delta_rule)
    mq.torch_chunk_gated_delta_rule = functools.partial(base, chunk_size=chunk_size)


def save_model(model, tok: Tokenizer, out: Path, config: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config or MODEL_CONFIG, indent=2) + "\n")
    gen_cfg = {"eos_token_id": MODEL_CONFIG["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg) + "\n")
    tok.save(str(out / "tokenizer.json"))


def export_sharded(model, tok: Tokenizer, out: Path, shards: int = 2, config: dict | None = None) -> None:
    """A copy in several safetensors shards plus model.safetensors.index.json (for transports that
    cap the size of one file); config and tokenizer as in save_model."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}) + "\n")
    (out / "config.json").write_text(json.dumps(config or MODEL_CONFIG, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))


def install_from_export(src: Path, out: Path) -> None:
    """Merge an export_sharded copy (e.g. the files a GPU run sent back) into one model directory."""
    from safetensors.torch import load_file

    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for fname in sorted(set(weight_map.values())):
        state.update(load_file(str(src / fname)))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    (out / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    gen_cfg = {"eos_token_id": MODEL_CONFIG["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg) + "\n")


def loss_fn(logits, ids, valid, ans, answer_weight: float = ANSWER_WEIGHT):
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    v, a = valid[:, 1:], ans[:, 1:]
    lm = nll[v].mean()
    qa = nll[a].mean()
    return lm + answer_weight * qa, lm, qa


@torch.no_grad()
def answer_accuracy(
    model,
    tok: Tokenizer,
    split: str,
    n: int,
    hops: int,
    device,
    min_docs,
    max_docs,
    seed=0,
    filler=1.0,
    distinct_initials=False,
    short_names=False,
):
    """Teacher-forced exact match: every answer token (and the closing newline) is the argmax.
    This is what greedy decoding up to the newline returns. `filler` < 1 shortens the documents
    (as the filler curriculum does; 1 = the evaluated task)."""
    gen = QAGenerator(split, seed, min_docs, max_docs)
    gen.filler = filler
    gen.distinct_initials = distinct_initials
    gen.short_names = short_names
    model.eval()
    right = 0
    for _ in range(n):
        ids, ans = encode_prompt(tok, [gen.example(hops)])
        x = torch.tensor([ids], device=device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x).logits[0]
        pred = logits[:-1].argmax(-1)
        m = torch.tensor(ans[1:], device=device, dtype=torch.bool)
        right += bool((pred[m] == x[0, 1:][m]).all())
    model.train()
    return right / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=100000, help="stop after this many steps")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds; 0 = no limit, schedule by steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-docs", type=int, default=8)
    p.add_argument("--max-docs", type=int, default=16)
    p.add_argument("--questions", type=int, default=4, help="questions per training prompt")
    p.add_argument(
        "--curriculum",
        type=float,
        default=0.3,
        help="fraction of training over which documents per prompt ramp from 2-3 to --min/--max-docs (0 = off)",
    )
    p.add_argument(
        "--filler-ramp",
        type=float,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("START", "END"),
        help="fractions of training: documents without filler before START, full filler from END",
    )
    p.add_argument(
        "--gdn-chunk",
        type=int,
        default=256,
        help="chunk length of the pure-torch gated delta rule (transformers' default 64; 256 was 1.2x faster "
        "forward+backward on CPU)",
    )
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--save-every", type=float, default=60.0, help="seconds between checkpoints")
    p.add_argument("--fla", action="store_true", help="let transformers use fla's kernels (default: hidden)")
    p.add_argument("--export", default="", help="also write a 2-shard copy here at every checkpoint")
    p.add_argument("--val", type=int, default=64, help="validation questions per hop kind at each checkpoint")
    p.add_argument(
        "--init-from",
        default="",
        help="start from this model directory's weights and tokenizer (a model this script wrote)",
    )
    p.add_argument("--install-from", default="", help="only merge this export_sharded copy into --out")
    p.add_argument(
        "--hidden", type=int, default=256, help="model width (256 = the shipped model; smaller for proxies)"
    )
    p.add_argument("--layers", type=int, default=8, help="layers, every 4th full attention (8 = shipped)")
    p.add_argument(
        "--heads", type=int, default=4, help="attention and GDN heads, head dim hidden/heads (4 = shipped)"
    )
    p.add_argument("--answer-weight", type=float, default=ANSWER_WEIGHT, help="loss weight of answer tokens")
    p.add_argument(
        "--val-filler",
        type=float,
        default=1.0,
        help="filler share of validation documents (1 = the evaluated task; 0 = facts only, as --filler-ramp 1 1)",
    )
    p.add_argument(
        "--short-names-until",
        type=float,
        default=0.0,
        metavar="FRAC",
        help="train on one-syllable entity names (one-token keys) for this fraction of training, then on the "
        "task's names; validation stays on the task's names (a curriculum: binding is learnt on short keys first)",
    )
    p.add_argument(
        "--short-names-accuracy",
        type=float,
        default=0.0,
        metavar="ACC",
        help="end the short-name stage early at the first checkpoint whose 1-hop accuracy on short names reaches "
        "ACC (binding appears at a step that varies from run to run: tools/binding_probe.py)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument(
        "--long-memory",
        default="",
        metavar="L,...",
        help="fixed decays for the last heads of every Gated DeltaNet layer, one memory length in tokens a "
        "head (e.g. 32,256: keep 1 - 1/L of the state per token); pinned through training",
    )
    p.add_argument(
        "--distinct-initials",
        action="store_true",
        help="every entity of a prompt starts its surname (organisation: first word) with its own syllable, "
        "in training and validation (an easier binding task)",
    )
    args = p.parse_args(argv)
    if args.install_from:
        install_from_export(Path(args.install_from), Path(args.out))
        return 0
    if args.time_budget <= 0 and args.steps >= 100000:
        p.error("give --steps or --time-budget")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.hidden, args.layers, args.heads)
    kernels = gdn_kernel(args.fla)
    if kernels == "torch":
        set_gdn_chunk(args.gdn_chunk)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.jsonl", "w")
    t0 = time.time()
    if args.init_from:
        from safetensors.torch import load_file

        init = Path(args.init_from)
        tok = Tokenizer.from_file(str(init / "tokenizer.json"))
        config = json.loads((init / "config.json").read_text())
        model = build_model(args.seed, config)
        model.load_state_dict(load_file(str(init / "model.safetensors")))
        model = model.to(device)
    else:
        tok = train_tokenizer(seed=args.seed)
        model = build_model(args.seed, config).to(device)
    try:
        memories = [int(x) for x in args.long_memory.split(",") if x.strip()]
    except ValueError:
        p.error(f"--long-memory needs comma-separated integers, got {args.long_memory!r}")
    if any(m < 2 for m in memories):
        p.error("--long-memory lengths must be >= 2 tokens")
    try:
        pins = long_memory_heads(model, memories) if memories else []
    except ValueError as e:
        p.error(str(e))
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": n_params, "device": str(device), "gdn_kernel": kernels}), flush=True)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    if not 0.0 <= args.short_names_until <= 1.0:
        p.error("--short-names-until needs 0 <= FRAC <= 1")
    if not 0.0 <= args.short_names_accuracy <= 1.0 or (args.short_names_accuracy and not args.short_names_until):
        p.error("--short-names-accuracy needs 0 <= ACC <= 1 and --short-names-until")
    if not 0.0 <= args.filler_ramp[0] <= args.filler_ramp[1] <= 1.0:
        p.error("--filler-ramp needs 0 <= START <= END <= 1")
    stream = PromptStream(
        tok.to_str(),
        args.seed,
        args.min_docs,
        args.max_docs,
        args.questions,
        args.curriculum,
        tuple(args.filler_ramp),
        args.distinct_initials,
        args.short_names_until,
    )
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=args.batch,
        num_workers=args.workers,
        collate_fn=lambda b: collate(b, MODEL_CONFIG["pad_token_id"]),
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers),
        pin_memory=device.type == "cuda",  # so the copies below do not block the host
    )
    start = time.time()
    last_save = start
    step, tokens, lm, qa = 0, 0, float("nan"), float("nan")

    def progress() -> float:
        if args.time_budget > 0:
            return min(1.0, (time.time() - start) / args.time_budget)
        return step / args.steps

    def checkpoint(final: bool):
        rec = {
            "step": step,
            "tokens": tokens,
            "seconds": round(time.time() - start, 1),
            "lm_loss": lm,
            "qa_loss": qa,
        }
        if args.val:
            for h in (1, 2):
                rec[f"val_acc_{h}hop"] = answer_accuracy(
                    model,
                    tok,
                    "val",
                    args.val,
                    h,
                    device,
                    args.min_docs,
                    args.max_docs,
                    args.seed,
                    args.val_filler,
                    args.distinct_initials,
                )
            if progress() < args.short_names_until and not stream.short_names_done.value:
                # binding on the curriculum's one-syllable names while it trains on them (fresh
                # prompts of training-split names: the validation split has too few for it)
                rec["train_acc_1hop_short_names"] = answer_accuracy(
                    model, tok, "train", args.val, 1, device, args.min_docs, args.max_docs, args.seed + 7,
                    args.val_filler, args.distinct_initials, short_names=True,
                )
                if args.short_names_accuracy and rec["train_acc_1hop_short_names"] >= args.short_names_accuracy:
                    stream.short_names_done.value = 1  # binding learnt on short keys: the task's names from now on
                    rec["short_names_stage_ended"] = True
        save_model(model, tok, out, config)
        if args.export:
            export_sharded(model, tok, Path(args.export), config=config)
        rec["final"] = final
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)
        return rec

    model.train()
    for ids, valid, ans in loader:
        if step >= args.steps or (args.time_budget > 0 and time.time() - start >= args.time_budget):
            break
        frac = progress()
        stream.progress.value = frac
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        # counted on the host: reading a device tensor each step would make the host wait for the
        # GPU, and launching the next step could no longer overlap this one
        n_valid = int(valid.sum())
        ids, valid, ans = (t.to(device, non_blocking=True) for t in (ids, valid, ans))
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids).logits
        loss, lm_t, qa_t = loss_fn(logits, ids, valid, ans, args.answer_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if pins:
            pin_long_memory(pins)  # no gradient into the pinned decays, before the clipping sees them
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if pins:
            pin_long_memory(pins)  # and back to the pinned values (AdamW's weight decay moves A_log)
        step += 1
        tokens += n_valid
        if step % 25 == 0 or step == 1:
            lm, qa = round(lm_t.item(), 4), round(qa_t.item(), 4)
            print(
                json.dumps(
                    {
                        "step": step,
                        "lr": round(lr, 6),
                        "lm_loss": lm,
                        "qa_loss": qa,
                        "seconds": round(time.time() - start, 1),
                    }
                ),
                flush=True,
            )
        if time.time() - last_save >= args.save_every:
            checkpoint(False)
            last_save = time.time()
    lm, qa = round(lm_t.item(), 4), round(qa_t.item(), 4)
    rec = checkpoint(True)
    rec.update(
        params=n_params,
        device=str(device),
        gdn_kernel=kernels,
        total_seconds=round(time.time() - t0, 1),
        seed=args.seed,
        batch=args.batch,
        long_memory=memories,
    )
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())

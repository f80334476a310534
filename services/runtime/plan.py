"""The request plan, importable without torch: what a request is (parsed and validated), its
tokens, the keys of its segment entries and of its part chain, and the bytes each entry will take.
The engine plans with it before it runs anything; the router plans with it and runs nothing.

    planner = Planner(model_cfg, tokenizer, runtime_config, fingerprint)
    req = planner.parse({"segments": [...], "suffix": "..."})   # RequestError on bad input
    [(seg.index, seg.key, seg.nbytes) for seg in planner.reused_segments(req)]
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from dataclasses import dataclass, field, replace

import numpy as np
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.sampling import GenerationDefaults, RequestError, SamplingParams

CACHE_FORMAT = "hc-entry-v1"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def packed_ids(token_ids) -> bytes:
    """Token ids as little-endian int64 bytes, what entry and chain keys hash. Packed in C by
    array (a segment of thousands of ids costs microseconds, not a Python loop over them)."""
    a = array.array("q", token_ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def segment_key(fingerprint: str, seam_window: int, token_ids, packed: bytes | None = None) -> str:
    """hash(model fingerprint, cache format, w, token ids) (docs/concepts.md, "Segment entries and
    the seam window"). `packed`: the ids as packed_ids packs them, when the caller has them so."""
    h = hashlib.sha256()
    h.update(f"{fingerprint}|{CACHE_FORMAT}|w={seam_window}|".encode())
    h.update(packed_ids(token_ids) if packed is None else packed)
    return h.hexdigest()


# longest cache_salt accepted (vLLM takes any string; a key of a tenant fits in far less)
MAX_CACHE_SALT_CHARS = 256


def salted_key(key: str, salt: str) -> str:
    """The key of an entry or of a part chain in the key space of a cache salt (vLLM's
    `cache_salt`): a request with a salt hits only what requests with the same salt stored, and
    one without only what those without stored."""
    if not salt:
        return key
    return hashlib.sha256(f"salt|{len(salt)}|{salt}|{key}".encode()).hexdigest()


def chain_key(parent: str, kind: str, token_ids, packed: bytes | None = None) -> str:
    """The key of a part after the chain `parent` (the part-chain snapshots, cache/prefix.py)."""
    h = hashlib.sha256(f"{parent}|{kind}|".encode())
    h.update(packed_ids(token_ids) if packed is None else packed)
    return h.hexdigest()


def expected_entry_nbytes(cfg, body_tokens: int, dtype: str = "float32", state_dtype: str = "float32") -> int:
    """Bytes of an entry before it is built: T and S in `state_dtype` (fp32 unless the engine keeps
    them in bf16: RuntimeConfig.entry_state_dtype), conv tail and K/V in the model dtype (names)."""
    if hasattr(cfg, "entry_nbytes"):
        # the other families' configs live beside their models (models/registry.py), with torch
        import torch

        return cfg.entry_nbytes(body_tokens, getattr(torch, dtype), getattr(torch, state_dtype))
    esz, ssz = ITEMSIZE[dtype], ITEMSIZE[state_dtype]
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * cfg.linear_num_key_heads * dk + hv * dv
    per_linear = ssz * (hv * dk * dk + hv * dk * dv) + esz * conv_dim * (cfg.linear_conv_kernel_dim - 1)
    per_attn = 2 * esz * cfg.num_key_value_heads * cfg.head_dim * body_tokens
    return len(cfg.linear_layers) * per_linear + len(cfg.attention_layers) * per_attn


def _holds_bool(value: list, packed: np.ndarray) -> bool:
    """Whether the list `packed` was packed from holds a bool: only where it packed 0 or 1."""
    places = np.flatnonzero(packed <= 1)
    if len(places) > 64:
        return bool in set(map(type, value))
    return any(type(value[i]) is bool for i in places.tolist())


@dataclass(slots=True)
class Request:
    system_ids: list[int]
    segment_ids: list[list[int]]
    suffix_ids: list[int]
    sampling: SamplingParams
    # indices of segments that always run live, never cached (a chat template's markup between
    # content parts): their part kind is "live"
    live: frozenset[int] = frozenset()
    # segment index -> its ids as packed_ids packs them (little-endian int64), made as it was parsed
    packed: dict[int, bytes] = field(default_factory=dict, compare=False, repr=False)
    # (entry tag, seam window, segment index) -> its entry key, computed once (Planner.segment_key);
    # a request's segments never change (a preempted request's copy shares them and these)
    keys: dict[tuple, str] = field(default_factory=dict, compare=False, repr=False)
    # the request's cache salt (vLLM's cache_salt): its entries, part chains and prefix pages live
    # in a key space of their own (salted_key); "" shares the unsalted one
    cache_salt: str = ""

    @property
    def prompt_ids(self) -> list[int]:
        out = list(self.system_ids)
        for s in self.segment_ids:
            out += s
        return out + list(self.suffix_ids)

    def prompt_head(self, n: int) -> list[int]:
        """prompt_ids[:n], without building the rest of the prompt."""
        out = list(self.system_ids[:n])
        for s in self.segment_ids:
            if len(out) >= n:
                return out
            out += s[: n - len(out)]
        return out + list(self.suffix_ids[: max(0, n - len(out))])

    @property
    def prompt_len(self) -> int:
        """len(prompt_ids), without building the list."""
        return len(self.system_ids) + sum(map(len, self.segment_ids)) + len(self.suffix_ids)

    def parts(self) -> list[tuple[str, list[int]]]:
        parts = [("system", self.system_ids)] if self.system_ids else []
        parts += [("live" if i in self.live else "segment", s) for i, s in enumerate(self.segment_ids)]
        if self.suffix_ids:
            parts.append(("suffix", self.suffix_ids))
        return parts


@dataclass(frozen=True, slots=True)
class PlannedSegment:
    """A segment the request folds in from its entry."""

    index: int  # in request.segment_ids
    token_ids: list[int]
    key: str
    nbytes: int  # the entry's expected size


class Planner:
    """Plans requests for one served model and runtime config. Reads nothing but the model's
    config (vocabulary, context limit, layer shapes), the tokenizer and the runtime config."""

    def __init__(
        self,
        cfg,
        tokenizer,
        config: RuntimeConfig | None = None,
        fingerprint: str = "unfingerprinted",
        generation: GenerationDefaults | None = None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.config = config or RuntimeConfig()
        self.fingerprint = fingerprint
        # the model's generation_config.json: more stop ids, and the sampling defaults
        self.generation = generation or GenerationDefaults()
        # generation ends at the end tokens the model's config files list, as in transformers and
        # vLLM: a chat template's end-of-turn token ends it where generation_config.json lists it
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(self.generation.eos_token_ids)
        self._nbytes: dict[tuple, int] = {}  # entry_nbytes by (segment tokens, config fields)

    def parse(self, obj, json_ids: bool = False) -> Request:
        """Validate a request object ({"system", "segments", "suffix", "sampling_params"}).

        `json_ids`: the object's lists of ids are as a JSON parser gives them (numbers are int,
        float or bool): a list that packs as int64 and holds no bool holds plain ints already, and
        is kept as it is rather than copied (the same checks; a request body's lists are its own)."""
        if not isinstance(obj, dict):
            raise RequestError("a request must be a JSON object")
        unknown = sorted(set(obj) - {"system", "segments", "suffix", "sampling_params", "id", "mode", "live_segments",
                                     "cache_salt"})
        if unknown:
            raise RequestError(f"unknown request field(s): {', '.join(unknown)}")
        salt = obj.get("cache_salt")
        salt = "" if salt is None else salt
        if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
            raise RequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        segments = obj.get("segments", [])
        if segments is None:
            segments = []
        if not isinstance(segments, list):
            raise RequestError("segments must be a list of strings or token-id lists")
        if len(segments) > self.config.max_segments:
            raise RequestError(f"too many segments: {len(segments)} (limit {self.config.max_segments})")
        # Refused before anything is tokenized: text longer than any request that could fit.
        chars = sum(len(v) for v in (obj.get("system"), *segments, obj.get("suffix")) if isinstance(v, str))
        if chars > self.max_chars:
            raise RequestError(f"the request's text has {chars} characters, more than the {self.max_chars} "
                               f"that could fit in the served length")
        # and token-id lists longer than the context, before their ids are checked one by one
        given = sum(len(v) for v in (obj.get("system"), *segments, obj.get("suffix")) if isinstance(v, list))
        if given > self.context_limit:
            raise RequestError(f"prompt of {given} tokens exceeds {self._limit_name(given)}")
        seg_ids, packed = self._segments(segments, json_ids)
        for i, s in enumerate(seg_ids):
            if not s:
                raise RequestError(f"segment {i} is empty")
        suffix = obj.get("suffix", "")
        suffix_ids = self._ids(suffix, "suffix") if suffix not in (None, "") else []
        system = obj.get("system")
        system_ids = self._ids(system, "system") if system not in (None, "") else []
        if not seg_ids and not suffix_ids:
            raise RequestError("the request has no segments and no suffix: nothing to run")
        sampling = SamplingParams.from_dict(obj.get("sampling_params"), defaults=self.generation.sampling_defaults())
        n = len(system_ids) + sum(map(len, seg_ids)) + len(suffix_ids)
        limit = self.context_limit
        if sampling.max_new_tokens is None:
            # no max_new_tokens from the request nor the model: what is left of the context (vLLM's default)
            if n >= limit:
                raise RequestError(f"prompt of {n} tokens leaves no room to generate within {self._limit_name()}")
            sampling = replace(sampling, max_new_tokens=limit - n)
        live = obj.get("live_segments") or []
        if not isinstance(live, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(seg_ids) for i in live
        ):
            raise RequestError("live_segments must be a list of segment indices")
        req = Request(system_ids, seg_ids, suffix_ids, sampling, frozenset(live),
                      {i: b for i, b in packed.items() if b is not None}, cache_salt=salt)
        if n + sampling.max_new_tokens > limit:
            raise RequestError(
                f"prompt of {n} tokens plus max_new_tokens {sampling.max_new_tokens} exceeds "
                + self._limit_name(n + sampling.max_new_tokens)
            )
        return req

    def _limit_name(self, tokens: int = 0) -> str:
        """The limit a request of this many tokens is over: the model's own, else --max-model-len."""
        model = self.cfg.max_position_embeddings
        if tokens <= model and self.context_limit < model:
            return f"this server's max model length of {self.context_limit} tokens"
        return f"the model's context limit of {model} tokens"

    @property
    def max_chars(self) -> int:
        """The character bound of a request's text (RuntimeConfig.max_prompt_chars)."""
        if self.config.max_prompt_chars is not None:
            return self.config.max_prompt_chars
        limit = self.config.max_model_len or self.cfg.max_position_embeddings
        return limit * self.tokenizer.max_token_chars

    @property
    def context_limit(self) -> int:
        """Prompt plus generated tokens: the model's max_position_embeddings, or less by --max-model-len."""
        limit = self.cfg.max_position_embeddings
        return min(limit, self.config.max_model_len) if self.config.max_model_len else limit

    def _segments(self, segments: list, json_ids: bool = False) -> tuple[list[list[int]], dict[int, bytes | None]]:
        """Every segment's ids and packed bytes (_segment_ids of each). When all of them are int
        arrays (a combine worker's gRPC Segments) or all non-empty lists that pack as int64 (a
        JSON body), their bools and range are checked once over all of them (one pass in numpy,
        not two reductions per segment); a refusal, and any other mix, goes segment by segment
        (its message names the segment)."""
        ok = None
        if segments and all(type(s) is np.ndarray and s.ndim == 1 and s.dtype.kind in "iu" for s in segments):
            ok = self._in_range(np.concatenate(segments))
            if ok:
                return [s.tolist() for s in segments], {i: s.astype("<i8").tobytes() for i, s in enumerate(segments)}
        elif segments and all(type(s) is list and s for s in segments):
            try:
                # struct packs a list of ints in about half array.array's time
                packs = [struct.pack(f"<{len(s)}q", *s) for s in segments]
            except (struct.error, TypeError, OverflowError):
                packs = None
            if packs is not None:
                a = np.frombuffer(b"".join(packs), dtype="<i8")
                ok = self._in_range(a) and not self._any_bool(segments, a)
                if ok and json_ids:
                    return list(segments), dict(enumerate(packs))
                if ok:
                    # plain ints, whatever integer type the caller gave
                    return [np.frombuffer(p, dtype="<i8").tolist() for p in packs], dict(enumerate(packs))
        seg_ids, packed = [], {}
        for i, s in enumerate(segments):
            ids, packed[i] = self._segment_ids(s, f"segment {i}")
            seg_ids.append(ids)
        return seg_ids, packed

    def _in_range(self, ids: np.ndarray) -> bool:
        return not len(ids) or (ids.min() >= 0 and ids.max() < self.cfg.vocab_size)

    @staticmethod
    def _any_bool(segments: list[list], packed: np.ndarray) -> bool:
        """Whether a segment holds a bool, `packed` all of them packed one after another: only a
        segment where 0 or 1 was packed is looked at (_holds_bool)."""
        places = np.flatnonzero(packed <= 1)
        if not len(places):
            return False
        ends = np.cumsum([len(s) for s in segments])
        starts = ends - np.array([len(s) for s in segments])
        for k in np.unique(np.searchsorted(ends, places, side="right")).tolist():
            if _holds_bool(segments[k], packed[starts[k]:ends[k]]):
                return True
        return False

    def _segment_ids(self, value, what: str) -> tuple[list[int], bytes | None]:
        """A segment's ids and, where they are not text, their packed_ids bytes. An int32 numpy
        array (ids unpacked from a gRPC Segment: integers by construction) is checked in numpy;
        a list of ids is packed once in C (which refuses what is not an integer), checked for
        booleans where it holds 0 or 1 (what True and False pack as) and range-checked on the
        packed array. Anything else, and a refusal, goes the checks of _ids (their messages)."""
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind not in "iu":
                raise RequestError(f"{what} must be a string or a list of token ids")
            self._check_range(value, what)
            return value.tolist(), value.astype("<i8").tobytes()
        if isinstance(value, list) and value:
            try:
                # struct packs a list of ints in about half array.array's time
                packed = struct.pack(f"<{len(value)}q", *value)
            except (struct.error, TypeError, OverflowError):
                packed = None
            if packed is not None:
                a = np.frombuffer(packed, dtype="<i8")
                if not _holds_bool(value, a):
                    self._check_range(a, what)
                    return a.tolist(), packed  # plain ints, whatever integer type the caller gave
        return self._ids(value, what), None

    def _check_range(self, ids: np.ndarray, what: str) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            bad = next(int(t) for t in ids if not 0 <= t < self.cfg.vocab_size)
            raise RequestError(f"{what} has token id {bad} outside the vocabulary [0, {self.cfg.vocab_size})")

    def _ids(self, value, what: str) -> list[int]:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{what} is not valid Unicode text (a lone surrogate at {e.start})") from None
            return self.tokenizer.encode(value)
        # The checks run in C (type of each id, min and max), not a Python loop over the ids: a
        # request of 32k ids is validated in well under a millisecond. bool is its own type, so
        # True/False are refused as ids.
        if isinstance(value, list) and (not value or set(map(type, value)) == {int}):
            if value and (min(value) < 0 or max(value) >= self.cfg.vocab_size):
                bad = next(t for t in value if not 0 <= t < self.cfg.vocab_size)
                raise RequestError(
                    f"{what} has token id {bad} outside the vocabulary [0, {self.cfg.vocab_size})"
                )
            return list(value)
        raise RequestError(f"{what} must be a string or a list of token ids")

    @property
    def entry_tag(self) -> str:
        """Model fingerprint, plus the entry policy when entries are not exact (a single-state entry
        must never answer an exact lookup, in this engine's store or in a shared cache tier) and the
        state dtype when it is not fp32 (nor may a rounded one), and the tensor-parallel size above 1
        (each rank's entries hold its heads only: another split must miss)."""
        tag = self.fingerprint
        if self.config.tensor_parallel_size > 1:
            tag += f"|tp={self.config.tensor_parallel_size}"
        if self.config.entry_policy != "exact":
            tag += f"|{self.config.entry_policy}"
        if self.config.entry_state_dtype != "float32":
            tag += f"|states={self.config.entry_state_dtype}"
        return tag

    def entry_key(self, segment_ids: list[int]) -> str:
        return segment_key(self.entry_tag, self.config.seam_window, segment_ids)

    def segment_key(self, req: Request, index: int) -> str:
        """The entry key of the request's segment `index` (entry_key of its ids), computed once
        per request and served model (Request.keys), from the ids packed as they were parsed."""
        memo = (self.entry_tag, self.config.seam_window, index)
        key = req.keys.get(memo)
        if key is None:
            key = segment_key(memo[0], memo[1], req.segment_ids[index], req.packed.get(index))
            key = req.keys[memo] = salted_key(key, req.cache_salt)
        return key

    def cacheable(self, segment_ids: list[int]) -> bool:
        """A body needs at least conv_width - 1 tokens: its conv tail must come from the body itself."""
        return len(segment_ids) - self.config.seam_window >= max(1, self.cfg.linear_conv_kernel_dim - 1)

    def entry_nbytes(self, segment_tokens: int) -> int:
        """Expected bytes of the entry of a segment of this many tokens (its body: all but the seam),
        worked out once per length and config (a function of them alone; a request of 32
        documents of one length asks 32 times)."""
        c = self.config
        memo = (segment_tokens, c.seam_window, c.dtype, c.entry_state_dtype)
        nbytes = self._nbytes.get(memo)
        if nbytes is None:
            if len(self._nbytes) >= 4096:
                self._nbytes.clear()
            nbytes = self._nbytes[memo] = expected_entry_nbytes(self.cfg, segment_tokens - c.seam_window, c.dtype,
                                                                c.entry_state_dtype)
        return nbytes

    def prefix_root(self) -> str:
        """The chain key before the first part: exact prefixes share one root per model; pic and
        naive chains are approximate and belong to their mode, seam window and entry kind."""
        mode = self.config.mode
        tag = "exact" if mode == "prefix" else f"{mode}-w{self.config.seam_window}"
        return chain_key(self.entry_tag if mode != "prefix" else self.fingerprint, tag, [])

    def chain_keys(self, req: Request) -> list[str]:
        """The part-chain key after each part of the request (from the root of its cache salt)."""
        keys, k = [], salted_key(self.prefix_root(), req.cache_salt)
        first_segment = 1 if req.system_ids else 0
        for j, (kind, ids) in enumerate(req.parts()):
            packed = req.packed.get(j - first_segment) if kind in ("segment", "live") else None
            k = chain_key(k, kind, ids, packed)
            keys.append(k)
        return keys

    def reused_segments(self, req: Request) -> list[PlannedSegment]:
        """The segments a request folds in from entries when no prefix of it is cached (the
        engine may reuse more of it from the prefix cache): in pic and naive every segment but a
        last part, when its body is long enough."""
        if not self.config.uses_entries:
            return []
        out = []
        for i, ids in enumerate(req.segment_ids):
            last = not req.suffix_ids and i == len(req.segment_ids) - 1
            if not last and i not in req.live and self.cacheable(ids):
                out.append(PlannedSegment(i, ids, self.segment_key(req, i), self.entry_nbytes(len(ids))))
        return out

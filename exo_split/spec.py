"""ModelSpec: what two sides must agree on for a KV cache to move between them.

Read from a Hugging Face checkpoint's config.json, no torch or mlx imports. Both the old
layout (`rope_theta`, `rope_scaling`) and the transformers-5 layout (`rope_parameters`)
are read into one canonical form, because this is where silent errors live: a backend
that misses a rope setting still produces tokens, just wrong ones.

A checkpoint's weight quantization (`Quantization`, as mlx_lm.convert writes it) is not part
of the maths: a 4-bit copy of a model holds the same KV layout and has the same fingerprint,
so a full-precision prefill node can hand its KV to a quantized decode node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exo_split import families, rope
from exo_split.errors import BadCheckpoint, ExoSplitError, IncompatiblePeer, PromptTooLong

SUPPORTED_ARCHITECTURES = tuple(families.FAMILIES)


@dataclass(frozen=True)
class ModelSpec:
    """The maths of a checkpoint. Equal fingerprints <=> a KV cache from one side is valid on the other."""

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer, "full_attention" or "sliding_attention" (empty: every layer full), and the
    # family's own fields (families.py), sorted (key, value) pairs with lists as tuples.
    layer_types: tuple[str, ...] = ()
    extras: tuple[tuple[str, Any], ...] = ()
    # V's width where it is not K's (`head_dim`): a latent (MLA) model's layers cache the
    # latent as K (n_kv_heads 1, head_dim kv_lora_rank) and the roped key as V (layers.py).
    value_dim: int | None = None
    # Informational only: not part of the fingerprint (a float16 and a bfloat16 copy of the
    # same weights are the same model; the dtype on the wire is negotiated per request).
    name: str = field(default="", compare=False)
    checkpoint_dtype: str | None = field(default=None, compare=False)

    @property
    def v_dim(self) -> int:
        """The width of each head's V in the cache (K's is `head_dim`)."""
        return self.value_dim or self.head_dim

    def layer_bytes_per_token(self, itemsize: int) -> int:
        """K and V bytes of one position of one layer, at `itemsize` bytes per element."""
        return self.n_kv_heads * (self.head_dim + self.v_dim) * itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes per prompt token over all layers, at 2 bytes per element."""
        return self.n_layers * self.layer_bytes_per_token(2)

    def maths(self) -> dict[str, Any]:
        """The fingerprinted fields as a plain dict (rope scaling as a dict)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        out["rope_scaling"] = dict(self.rope_scaling)
        if not self.layer_types:  # absent when every layer is full: fingerprints stay
            del out["layer_types"]
        if self.value_dim is None:  # absent when V is as wide as K: fingerprints stay
            del out["value_dim"]
        del out["extras"]
        for key, value in self.extras:  # the family's fields, under their config.json names
            out[f"{self.architecture}.{key}"] = value
        return out

    @property
    def window_limit(self) -> int | None:
        """The most positions a request may reach, set by a sliding window that mlx-lm's
        module of this family never applies (it attends over every position: exact only
        inside the window). Families with typed layers (layer_types) mask the window per
        layer on both sides, so a prompt may run past it."""
        return None if self.layer_types else self.sliding_window

    @property
    def position_limit(self) -> int | None:
        """The most positions a request may reach short of the context: the window of
        `window_limit`, or where longrope would switch to its long factors (rope.limit)."""
        limits = [x for x in (self.window_limit, rope.limit(dict(self.rope_scaling))) if x]
        return min(limits) if limits else None

    @property
    def window_keep(self) -> tuple[int | None, ...]:
        """Per layer, how many of the prompt's last positions a decode side must hold: W - 1
        for a sliding layer (the next query is the window's W-th position), None (all) for a
        full one. Empty when every layer is full."""
        if not (self.layer_types and self.sliding_window):
            return ()
        return tuple(self.sliding_window - 1 if t == families.SLIDING else None
                     for t in self.layer_types)  # fmt: skip

    def extra(self, key: str, default: Any = None) -> Any:
        return dict(self.extras).get(key, default)

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.maths(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.maths().items() if not k.startswith(f"{self.architecture}.")}
        out["extras"] = dict(self.extras)
        out["name"] = self.name
        out["checkpoint_dtype"] = self.checkpoint_dtype
        out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["rope_scaling"] = _frozen_items(d.get("rope_scaling") or {})
        kwargs["layer_types"] = tuple(d.get("layer_types") or ())
        kwargs["extras"] = _frozen_items(d.get("extras") or {})
        return cls(**kwargs)


def _frozen(v: Any) -> Any:
    """JSON lists as tuples, so that a spec read back from the wire equals the original."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list | tuple) else v


def _frozen_items(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, _frozen(v)) for k, v in d.items()))


def _rope(
    config: dict[str, Any], fam: families.Family
) -> tuple[float, tuple[tuple[str, Any], ...], dict[str, Any]]:
    """(theta, scaling, rope fields of the family) from either layout. transformers 5 may key
    rope_parameters by layer type: the full layers' entry is the model's rope; the sliding
    layers' own theta is `rope_local_base_freq` where the family has one, else it must match."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    local = None
    if families.FULL in params or families.SLIDING in params:
        local = params.get(families.SLIDING)
        params = params.get(families.FULL) or local or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    longrope = (merged.get("rope_type") or merged.get("type")) == "longrope"
    if longrope and "original_max_position_embeddings" not in merged:  # older files: the top
        merged["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    max_pos = int(config.get("max_position_embeddings") or 2048)
    scaling = tuple(sorted(rope.canonical(merged, max_position_embeddings=max_pos).items()))
    extra = {k: merged.get(k, config.get(k)) for k in families.ROPE_FIELDS if k in fam.fields}
    if local is not None:
        local_theta = float(local.get("rope_theta", theta))
        if "rope_local_base_freq" in fam.fields:
            extra["rope_local_base_freq"] = local_theta
        elif local_theta != theta:
            raise BadCheckpoint(
                f"the sliding layers' rope theta ({local_theta}) differs from the full "
                f"layers' ({theta}): exo-split's {config.get('model_type')} runs one theta"
            )
        if rope.canonical(dict(local), max_position_embeddings=max_pos):
            raise BadCheckpoint("rope scaling on the sliding layers is not supported")
    return theta, scaling, {k: v for k, v in extra.items() if v is not None}


def _layer_types(arch: str, fam: families.Family, config: dict[str, Any], n: int):
    """Per layer type and the window W that sliding layers attend over (None: no window)."""
    if fam.recurrent:
        return _recurrent_layer_types(arch, config, n), None
    window = config.get("sliding_window")
    uses = {
        None: False,
        "always": True,
        "flag": bool(config.get("use_sliding_window")),
        "layer_types": True,
    }[fam.window]
    if not (uses and window):
        return (), None
    if fam.window != "layer_types":
        return (), int(window)  # every layer slides: the spec's window says so
    types = tuple(config.get("layer_types") or families.default_layer_types(arch, n, config))
    if len(types) != n or set(types) - {families.FULL, families.SLIDING}:
        raise BadCheckpoint(
            f"layer_types must name {n} layers, each {families.FULL!r} or "
            f"{families.SLIDING!r}; got {list(types)}"
        )
    if fam.mlx_pattern and families.window_pattern(types) is None:
        raise BadCheckpoint(
            f"{arch}: mlx-lm takes a repeating window pattern (P-1 sliding layers, then one "
            f"full); these layer_types follow none: {list(types)}"
        )
    return types, int(window)


def _recurrent_layer_types(arch: str, config: dict[str, Any], n: int) -> tuple[str, ...]:
    """A hybrid's layers: recurrent ones and full attention in mlx-lm's fixed pattern (every
    P-th layer full: `full_attention_interval`)."""
    old_names = {"mamba": families.LINEAR, "attention": families.FULL}  # Granite 4's own
    types = tuple(config.get("layer_types") or families.default_layer_types(arch, n, config))
    types = tuple(old_names.get(t, t) for t in types)
    if families.FAMILIES[arch].mlx_layer_names:  # mlx-lm takes the list as it is
        if len(types) != n or set(types) - {families.LINEAR, families.FULL}:
            raise BadCheckpoint(f"{arch}: layer_types must name {n} layers, each "
                                f"{families.LINEAR!r} or {families.FULL!r}; got {list(types)}")  # fmt: skip
        return types
    if len(types) != n or families.window_pattern(types, families.LINEAR) is None:
        raise BadCheckpoint(
            f"{arch}: mlx-lm runs P-1 {families.LINEAR!r} layers, then one "
            f"{families.FULL!r}, repeated over all {n} layers; these layer_types follow no "
            f"such pattern: {list(types)}"
        )
    return types


def _family_fields(fam: families.Family, config: dict[str, Any], n_layers: int) -> dict:
    out = {}
    for key, default in fam.fields.items():
        value = config.get(key, config.get(fam.aliases.get(key, ""), default))
        if key == "mlp_layer_types" and value is None:  # transformers' own default
            value = ["dense"] + ["sparse"] * (n_layers - 1)
        if key == "no_rope_layers" and value is None:  # transformers' own default pattern
            interval = int(config.get("no_rope_layer_interval", 4))
            value = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if key == "layer_types":
            continue  # ModelSpec.layer_types
        if key == "mamba_d_head" and value in (None, "auto"):
            value = int(config.get("mamba_expand", 2)) * int(config["hidden_size"])
            value //= int(config.get("mamba_n_heads", fam.fields["mamba_n_heads"]))
        if key == "time_step_limit" and value is not None:  # transformers 5 writes an
            # infinity as {"__float__": "Infinity"}; kept as strings (the wire's JSON has none)
            value = tuple(str(float(x["__float__"] if isinstance(x, dict) else x)) for x in value)
        out[key] = value
    return out


def spec_from_config(config: dict[str, Any], *, name: str = "") -> ModelSpec:
    """Canonical ModelSpec from a config.json dict; raises BadCheckpoint on what we cannot run."""
    config = text_model_config(config)
    arch = config.get("model_type")
    fam = families.family(arch)
    if fam is None:
        why = families.REFUSED.get(arch or "")
        raise BadCheckpoint(
            f"unsupported architecture {arch!r}"
            + (f": {why}" if why else "")
            + f"; exo-split supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    reason = fam.refuse(config) if fam.refuse else None
    if reason:
        raise BadCheckpoint(f"{arch}: {reason}")
    try:
        n_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        n_layers = int(config["num_hidden_layers"])
        n_kv = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or hidden // n_heads)
        value_dim = None
        if fam.latent:  # what the cache holds: the latent (K) and the roped key (V), one head
            n_kv, value_dim = 1, int(config.get("qk_rope_head_dim", fam.fields["qk_rope_head_dim"]))
            head_dim = int(config.get("kv_lora_rank", fam.fields["kv_lora_rank"]))
        theta, scaling, rope_fields = _rope(config, fam)
        kind = dict(scaling).get("rope_type")
        if kind is not None and kind not in fam.mlx_rope:
            raise BadCheckpoint(
                f"{arch} with {kind} rope scaling: mlx-lm's {arch} module builds a plain RoPE "
                "and never applies it, so the two sides would rotate differently"
            )
        layer_types, window = _layer_types(arch, fam, config, n_layers)
        extras = _family_fields(fam, config, n_layers) | rope_fields
        eps = config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-6))
        return ModelSpec(
            architecture=arch,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden_size=hidden,
            # a model of experts only (qwen3_5_moe_text) has no dense MLP: its experts' size
            intermediate_size=int(
                config.get("intermediate_size") or config["moe_intermediate_size"]
            ),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=fam.qkv_bias or bool(config.get("attention_bias", False)),
            qk_norm=fam.qk_norm,
            sliding_window=window,
            layer_types=layer_types,
            extras=_frozen_items(extras),
            value_dim=value_dim,
            name=name,
            checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCheckpoint(f"config.json is missing or has a bad value for {exc}") from exc


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text model (families.TEXT_OF) as a config of its own;
    any other config as it is. The same text model fingerprints alike in either form."""
    text, nested = families.TEXT_OF.get(config.get("model_type") or ""), config.get("text_config")
    if text is None or not isinstance(nested, dict):
        return config
    return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **nested,
            "model_type": text}  # fmt: skip


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read and validate a checkpoint directory (config.json, weights, tokenizer)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise BadCheckpoint(
            f"{path} is not a directory", hint="--model takes a checkpoint directory"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise BadCheckpoint(
            f"{path} is not a Hugging Face checkpoint: no config.json",
            hint="point --model at a directory holding config.json, *.safetensors and tokenizer.json",
        )
    if not any(path.glob("*.safetensors")):
        raise BadCheckpoint(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise BadCheckpoint(f"{path} has no tokenizer.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadCheckpoint(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise BadCheckpoint(f"{config_file} is not a JSON object")
    return spec_from_config(config, name=path.name)


def differences(a: ModelSpec, b: ModelSpec) -> list[str]:
    """Human-readable 'field: a != b' for every fingerprinted field that differs."""
    ma, mb = a.maths(), b.maths()
    keys = list(ma) + [k for k in mb if k not in ma]
    return [f"{k}: {ma.get(k)!r} != {mb.get(k)!r}" for k in keys if ma.get(k) != mb.get(k)]


def require_compatible(local: ModelSpec, remote: ModelSpec, *, what: str = "peer") -> None:
    """Refuse to exchange KV between different models, naming the differing fields."""
    diff = differences(local, remote)
    if diff:
        raise IncompatiblePeer(
            f"{what} runs a different model (fingerprint here {local.fingerprint}, "
            f"{what} {remote.fingerprint}); differing fields (here != {what}): " + "; ".join(diff),
            hint="load the same checkpoint (same config.json) on both machines",
        )


def check_request(spec: ModelSpec, prompt_len: int, max_tokens: int) -> None:
    """Refuse, with a clear message, a request the model cannot hold."""
    if prompt_len < 1:
        raise ExoSplitError("the prompt is empty: nothing to prefill")
    if max_tokens < 1:
        raise ExoSplitError(f"max tokens must be at least 1, got {max_tokens}")
    total = prompt_len + max_tokens
    if total > spec.max_position_embeddings:
        raise PromptTooLong(
            f"prompt ({prompt_len} tokens) + max tokens ({max_tokens}) = {total} exceeds the "
            f"model's context of {spec.max_position_embeddings}",
            hint="shorten the prompt or lower --max-tokens",
        )
    if spec.window_limit and total > spec.window_limit:
        raise PromptTooLong(
            f"prompt + max tokens = {total} exceeds the sliding window of {spec.window_limit}; "
            "exo-split does not support sliding-window attention beyond the window yet"
        )
    if spec.position_limit and total > spec.position_limit:
        raise PromptTooLong(
            f"prompt + max tokens = {total} exceeds {spec.position_limit} positions, where this "
            "model's longrope scaling switches to its long factors: transformers then rotates "
            "each forward by its own length, which a split cannot reproduce",
            hint="shorten the prompt or lower --max-tokens",
        )


def check_token_ids(spec: ModelSpec, token_ids) -> None:
    """Every id must index the embedding: on CUDA an out-of-range id is a device-side assert
    that poisons the whole process, so it is refused before any work."""
    bad = next((t for t in token_ids if not 0 <= t < spec.vocab_size), None)
    if bad is not None:
        raise ExoSplitError(
            f"token id {bad} is outside the vocabulary (ids 0..{spec.vocab_size - 1})"
        )


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's weights are quantized: mlx_lm.convert's / mlx-community's layout
    (`format` "mlx": MLX only), or OpenAI's MXFP4 gpt-oss files as transformers writes them
    (`format` "transformers": transformers dequantizes them where it has no MXFP4 kernels,
    mlx-lm runs them packed)."""

    bits: int
    group_size: int
    mode: str  # "affine" (mlx-lm's default), or mxfp4 / nvfp4 / mxfp8
    scales_dtype: str | None  # the dtype the scales (and biases) are stored in
    quantized: int  # weight matrices stored packed
    full_precision: int  # projection/embedding matrices convert left unquantized
    format: str = "mlx"

    @property
    def tag(self) -> str:
        """Short and stable, for cache keys and TXT records: 'q4g64-affine'."""
        return f"q{self.bits}g{self.group_size}-{self.mode}"

    def describe(self) -> str:
        mixed = (
            f", {self.full_precision} matrices left full precision" if self.full_precision else ""
        )
        return f"{self.bits}-bit {self.mode}, groups of {self.group_size}{mixed}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tag": self.tag}


def load_quantization(model_dir: str | Path) -> Quantization | None:
    """The quantization of a checkpoint (None: full precision), from config.json's
    `quantization` and the safetensors headers (no weights are read). Counting the packed
    matrices matters: convert silently leaves a matrix in full precision when its input
    dimension is not a multiple of the group size."""
    path = Path(model_dir)
    try:
        config = json.loads((path / "config.json").read_text())
        q = config.get("quantization") or config.get("quantization_config")
        fmt = "mlx"
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4" and "bits" not in q:
            q, fmt = {"bits": 4, "group_size": 32, "mode": "mxfp4"}, "transformers"
        if not isinstance(q, dict) or "bits" not in q:
            return None
        headers = [_safetensors_header(f) for f in sorted(path.glob("*.safetensors"))]
        dtypes = {k: v["dtype"] for h in headers for k, v in h.items() if k != "__metadata__"}
        scale_keys = [k for k in dtypes if k.endswith((".scales", "_scales"))]
        packed = {k.removesuffix(".scales").removesuffix("_scales") for k in scale_keys}
        plain = [
            k
            for k in dtypes
            if k.endswith(".weight")
            and k.removesuffix(".weight") not in packed
            and ("proj" in k or "embed" in k or "lm_head" in k)
        ]
        scales = sorted(scale_keys)
        return Quantization(
            bits=int(q["bits"]),
            group_size=int(q["group_size"]),
            mode=str(q.get("mode", "affine")),
            scales_dtype=_SAFETENSORS_DTYPES.get(dtypes[scales[0]]) if scales else None,
            quantized=len(packed),
            full_precision=len(plain),
            format=fmt,
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise BadCheckpoint(f"cannot read the quantization of {path}: {exc}") from exc


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the header is not a JSON object")
    return header

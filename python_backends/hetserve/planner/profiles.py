"""Static tables for the planner: model presets, hardware profiles, KV links and KV tiers.

Units used throughout: FLOP/s as TFLOPs (1e12), bandwidths as GB/s (1e9 bytes/s, *per direction*),
capacities as GB (1e9 bytes), prices as USD per device-hour.

Compute figures are *dense* peaks (no 2:4 sparsity) from the vendor datasheets cited next to each
entry. ``None`` marks a precision the hardware has no native compute path for; the cost model then
falls back to a wider precision and emits a ``precision_unsupported`` warning.

Prices are indicative on-demand cloud prices (2024-25) except where a paper is cited; override them
with ``hetserve plan --hw-file my_profile.json`` (see :meth:`HardwareProfile.from_dict`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "int8")
DTYPE_BYTES: Mapping[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# Lower is "more exact"; used only to break cost ties in favour of the higher precision.
PRECISION_RANK: Mapping[str, int] = {"fp32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "int8": 3}
# Compute precision used when a precision has no native path (weights keep their storage dtype).
PRECISION_FALLBACK: Mapping[str, tuple[str, ...]] = {
    "fp32": (),
    "bf16": ("fp16", "fp32"),
    "fp16": ("bf16", "fp32"),
    "fp8": ("fp16", "bf16", "fp32"),
    "int8": ("fp16", "bf16", "fp32"),
}


def check_precision(name: str) -> str:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
    return name


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers the cost model needs (decoder-only transformer)."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    params: float  # total parameter count (embeddings included)
    tied_embeddings: bool = False
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs plain 2-matrix MLP (OPT)
    max_context: int = 4096

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def embedding_params(self) -> int:
        """Input embedding plus (if untied) output projection."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def block_params(self) -> float:
        """Parameters inside the transformer blocks (those every token multiplies through)."""
        return self.params - self.embedding_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def estimate_params(self) -> int:
        """Parameter count implied by the architecture (norms and biases ignored)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (q_o + k_v + mlp) + self.embedding_params

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[check_precision(dtype)]

    def weight_bytes(self, precision: str) -> float:
        return self.params * DTYPE_BYTES[check_precision(precision)]

    def weight_read_bytes(self, precision: str) -> float:
        """Bytes of weights streamed per forward pass (block weights + LM head; embedding rows are gathers)."""
        return (self.block_params + self.lm_head_params) * DTYPE_BYTES[check_precision(precision)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Accept our own field names, HF ``config.json`` names and hetserve's LlamaConfig names.
    _ALIASES = {
        "num_hidden_layers": "layers", "num_layers": "layers", "n_layer": "layers",
        "num_attention_heads": "heads", "num_heads": "heads",
        "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads",
        "hidden_size": "hidden",
        "intermediate_size": "intermediate", "ffn_dim": "intermediate",
        "vocab_size": "vocab", "tie_word_embeddings": "tied_embeddings",
        "max_position_embeddings": "max_context", "max_position": "max_context",
        "num_parameters": "params", "_name_or_path": "name",
    }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: Optional[str] = None) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in d.items():
            target = cls._ALIASES.get(key, key)
            if target in fields and target not in kw:
                kw[target] = value
        kw.setdefault("name", name or "custom")
        kw.setdefault("kv_heads", kw.get("heads"))
        if "head_dim" not in kw and "hidden" in kw and "heads" in kw:
            kw["head_dim"] = kw["hidden"] // kw["heads"]
        if d.get("model_type") == "opt" or d.get("hidden_act") == "relu":
            kw.setdefault("gated_mlp", False)
        missing = {"layers", "heads", "head_dim", "hidden", "intermediate", "vocab"} - kw.keys()
        if missing:
            raise ValueError(f"model config lacks {', '.join(sorted(missing))}")
        if "params" not in kw:
            kw["params"] = cls(**{**kw, "params": 0.0}).estimate_params()
        return cls(**kw)


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    # HuggingFaceTB/SmolLM2-135M config.json; 134,515,008 parameters (tied embeddings).
    ModelConfig("smollm2-135m", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576,
                intermediate=1536, vocab=49152, params=134_515_008, tied_embeddings=True,
                max_context=8192),
    # meta-llama/Meta-Llama-3-8B config.json; 8.03e9 parameters.
    ModelConfig("llama3-8b", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096,
                intermediate=14336, vocab=128256, params=8.03e9, max_context=8192),
    # meta-llama/Llama-2-70b-hf config.json; 68.98e9 parameters (GQA, 8 KV heads).
    ModelConfig("llama2-70b", layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192,
                intermediate=28672, vocab=32000, params=68.98e9, max_context=4096),
    # facebook/opt-66b config.json (MHA, ReLU MLP, tied embeddings); ~65.7e9 parameters.
    ModelConfig("opt-66b", layers=64, heads=72, kv_heads=72, head_dim=128, hidden=9216,
                intermediate=36864, vocab=50272, params=65.7e9, tied_embeddings=True,
                gated_mlp=False, max_context=2048),
)}


# --------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HardwareProfile:
    """One device (GPU/accelerator/CPU socket). Instances use ``tp`` of these."""

    name: str
    tflops: Mapping[str, Optional[float]]  # dense peak per precision; None = unsupported
    mem_bw_gbs: float  # device memory bandwidth, GB/s
    mem_gb: float  # device memory capacity, GB
    price_per_hour: float  # USD per device-hour
    kind: str = "accelerator"  # "accelerator" or "cpu"
    host_link: Optional[str] = "pcie-gen5-x16"  # link to host DRAM (None: device memory *is* host DRAM)
    host_mem_gb: float = 256.0  # host DRAM available per device for the "host" KV tier
    kv_layout: str = "paged-nhd"  # native paged-KV layout of the usual serving stack
    max_tp: int = 8
    # Achievable fractions of peak; these are what ``calibrate`` fits.
    mfu: float = 0.5
    bw_eff: float = 0.8
    step_overhead_s: float = 0.0  # fixed cost per forward pass (launch, framework)
    request_overhead_s: float = 0.0  # fixed cost per request on the TTFT path (RPC, tokenizer)
    seq_overhead_s: float = 0.0  # fixed cost per sequence per forward pass (sampling, one streamed response)
    # Share of the shorter of a pass's memory and compute times hidden under the longer: 1 is the
    # roofline max() (GPU kernels overlap weight streaming with math); 0 makes them add up.
    overlap: float = 1.0
    # Memory passes over the materialised P x P fp32 attention scores per layer and head in prefill:
    # 0 for fused (flash) attention; an unfused MatMul -> Add(mask) -> Softmax -> MatMul graph makes ~6.
    attn_score_passes: float = 0.0
    source: str = ""

    def supports(self, precision: str) -> bool:
        return self.tflops.get(check_precision(precision)) is not None

    def supported_precisions(self) -> tuple[str, ...]:
        return tuple(p for p in PRECISIONS if self.supports(p))

    def compute_precision(self, precision: str) -> str:
        """The precision whose peak applies: ``precision`` itself or its first supported fallback."""
        for p in (precision, *PRECISION_FALLBACK[check_precision(precision)]):
            if self.supports(p):
                return p
        raise ValueError(f"{self.name} has no compute path for {precision}")

    def peak_flops(self, precision: str) -> float:
        return float(self.tflops[self.compute_precision(precision)]) * 1e12  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tflops"] = dict(self.tflops)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HardwareProfile":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown hardware profile fields: {', '.join(sorted(unknown))}")
        kw = dict(d)
        kw["tflops"] = {p: kw.get("tflops", {}).get(p) for p in PRECISIONS}
        return cls(**kw)


def _tf(fp32: Optional[float], bf16: Optional[float], fp16: Optional[float],
        fp8: Optional[float], int8: Optional[float]) -> dict[str, Optional[float]]:
    return {"fp32": fp32, "bf16": bf16, "fp16": fp16, "fp8": fp8, "int8": int8}


HARDWARE: dict[str, HardwareProfile] = {h.name: h for h in (
    # NVIDIA H100 SXM5 80GB datasheet: FP32 67 (66.9 in the Hopper whitepaper), BF16/FP16 989.4,
    # FP8 1978.9, INT8 1978.9 TOPS dense; HBM3 3.35 TB/s (3352 GB/s, Splitwise Table II); NVLink4.
    # Price: Splitwise (Patel et al., ISCA'24) Table II, DGX-H100 $38/h / 8 GPUs.
    HardwareProfile("h100", _tf(66.9, 989.4, 989.4, 1978.9, 1978.9), mem_bw_gbs=3352, mem_gb=80,
                    price_per_hour=38.0 / 8, source="NVIDIA H100 datasheet; Splitwise Table II"),
    # NVIDIA H200 SXM 141GB datasheet: same GH100 compute as H100; HBM3e 4.8 TB/s.
    HardwareProfile("h200", _tf(66.9, 989.4, 989.4, 1978.9, 1978.9), mem_bw_gbs=4800, mem_gb=141,
                    price_per_hour=5.50, source="NVIDIA H200 datasheet"),
    # NVIDIA A100 SXM4 80GB datasheet: FP32 19.5, BF16/FP16 312, INT8 624 TOPS dense, no FP8
    # tensor cores; HBM2e 2039 GB/s; PCIe Gen4. Price: Splitwise Table II, DGX-A100 $17.6/h / 8.
    HardwareProfile("a100", _tf(19.5, 312.0, 312.0, None, 624.0), mem_bw_gbs=2039, mem_gb=80,
                    price_per_hour=17.6 / 8, host_link="pcie-gen4-x16",
                    source="NVIDIA A100 datasheet; Splitwise Table II"),
    # NVIDIA H20 (export Hopper) spec sheet: FP32 44, BF16/FP16 148, FP8 296, INT8 296 dense;
    # HBM3 96 GB at 4.0 TB/s; NVLink 900 GB/s.
    HardwareProfile("h20", _tf(44.0, 148.0, 148.0, 296.0, 296.0), mem_bw_gbs=4000, mem_gb=96,
                    price_per_hour=1.80, source="NVIDIA H20 spec sheet"),
    # NVIDIA L40S datasheet: FP32 91.6, BF16/FP16 362.05, FP8 733, INT8 733 dense (half the
    # with-sparsity figures); GDDR6 48 GB at 864 GB/s; PCIe Gen4, no NVLink.
    HardwareProfile("l40s", _tf(91.6, 362.05, 362.05, 733.0, 733.0), mem_bw_gbs=864, mem_gb=48,
                    price_per_hour=1.30, host_link="pcie-gen4-x16", source="NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: FP32 30.3, BF16/FP16 121, FP8 242.5, INT8 242.5 dense (Ada has FP8);
    # GDDR6 24 GB at 300 GB/s; PCIe Gen4.
    HardwareProfile("l4", _tf(30.3, 121.0, 121.0, 242.5, 242.5), mem_bw_gbs=300, mem_gb=24,
                    price_per_hour=0.80, host_link="pcie-gen4-x16", source="NVIDIA L4 datasheet"),
    # AMD Instinct MI300X datasheet: FP32 (matrix) 163.4, BF16/FP16 1307.4, FP8 2614.9,
    # INT8 2614.9 dense; HBM3 192 GB at 5.3 TB/s; PCIe Gen5.
    HardwareProfile("mi300x", _tf(163.4, 1307.4, 1307.4, 2614.9, 2614.9), mem_bw_gbs=5300,
                    mem_gb=192, price_per_hour=3.50, source="AMD Instinct MI300X datasheet"),
    # Intel Gaudi 3 (HL-325L OAM) white paper: MME BF16 1835, FP8 1835, FP16/TF32 459, FP32 229;
    # no INT8 matrix path advertised; HBM2e 128 GB at 3.7 TB/s; PCIe Gen5.
    HardwareProfile("gaudi3", _tf(229.0, 1835.0, 459.0, 1835.0, None), mem_bw_gbs=3700, mem_gb=128,
                    price_per_hour=3.00, kv_layout="paged-hpu", source="Intel Gaudi 3 white paper"),
    # Huawei Ascend 910B: ~320 TFLOPS FP16/BF16 and 640 TOPS INT8 (figures vary by SKU, 910B1-B4
    # ~280-376), no FP8; HBM2e 64 GB at ~1.6 TB/s; PCIe Gen4. FP32 is not published: the value is
    # an estimate (about a quarter of FP16, as for the Cube unit's HF32 path).
    HardwareProfile("ascend910b", _tf(80.0, 320.0, 320.0, None, 640.0), mem_bw_gbs=1600,
                    mem_gb=64, price_per_hour=1.70, host_link="pcie-gen4-x16",
                    kv_layout="paged-nz", source="Huawei Ascend 910B public specs (approximate)"),
    # A small x86-64 CPU box (the local dev box / CI runner, 2 cores). Peak FP32 = 2 FMA pipes x
    # 16 lanes (AVX-512; 8 with AVX2 on 2 cores) x 2 FLOP x 3.0 GHz = 192 GFLOPs; INT8 via VNNI ~2x
    # FP32; no native BF16/FP16/FP8 matmul assumed (hetserve's CPU path runs FP32 with an FP32 KV
    # pool). Memory: dual-channel DDR4-3200 peak 51.2 GB/s, of which one or two cores reach well
    # under half. hetserve's local topology pins prefill and decode to one core each, so a "device"
    # here is what one server gets. ONNX Runtime's small-batch CPU GEMMs stream the weights and
    # compute on the same core, so memory and compute time add (overlap 0); hetserve's ONNX graph
    # materialises the attention scores (attn_score_passes 6). Fit mfu/bw_eff/overheads to the box
    # with ``hetserve plan --measure URL`` or ``--calibrate measurements.json``.
    HardwareProfile("cpu-local", _tf(0.192, None, None, None, 0.384), mem_bw_gbs=51.2, mem_gb=16,
                    price_per_hour=0.10, kind="cpu", host_link=None, host_mem_gb=0.0,
                    kv_layout="paged-hnd", max_tp=1, mfu=0.3, bw_eff=0.4, overlap=0.0,
                    attn_score_passes=6.0, source="AVX peak arithmetic; DDR4-3200 dual channel"),
)}


# --------------------------------------------------------------------------------------------
# Links (KV transport between prefill and decode) and KV tiers
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkProfile:
    name: str
    gbytes_per_s: float  # nominal payload bandwidth per direction, GB/s
    latency_s: float  # per message (one message per layer when transfer is layer-wise)
    efficiency: float = 0.85  # achievable fraction of nominal (calibrate_link fits this)
    per_device: bool = True  # one link per device, so a TP instance gets tp x bandwidth
    kinds: frozenset[str] = frozenset({"accelerator", "cpu"})  # endpoint kinds allowed
    hardware: Optional[frozenset[str]] = None  # explicit endpoint whitelist (None: any)
    same_hardware: bool = False  # both ends must be the same device type (one node)
    host_links: Optional[frozenset[str]] = None  # PCIe: the devices' own host link must be one of these
    tier: int = 0  # relative cost/complexity; lower wins a tie
    source: str = ""

    def connects(self, a: HardwareProfile, b: HardwareProfile) -> bool:
        ends = (a, b)
        return (all(h.kind in self.kinds for h in ends)
                and (self.hardware is None or all(h.name in self.hardware for h in ends))
                and (self.host_links is None or all(h.host_link in self.host_links for h in ends))
                and (not self.same_hardware or a.name == b.name))

    @property
    def bytes_per_s(self) -> float:
        return self.gbytes_per_s * 1e9 * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kinds"] = sorted(self.kinds)
        for name in ("hardware", "host_links"):
            value = getattr(self, name)
            d[name] = sorted(value) if value is not None else None
        return d


_GPU = frozenset({"accelerator"})
_GBIT = 1 / 8  # GB/s per Gbit/s

LINKS: dict[str, LinkProfile] = {l.name: l for l in (
    # Same host, shared-memory ring between two processes: bounded by memcpy on a small CPU.
    LinkProfile("loopback-shm", 10.0, 2e-6, efficiency=0.8, per_device=False,
                hardware=frozenset({"cpu-local"}), tier=0, source="memcpy bandwidth, 2-core host"),
    # Same host, KV as binary tensors of a Triton gRPC call (hetserve's `grpc` transport): protobuf
    # and socket copies on top of memcpy; fit it with measured transfers (hetserve plan --measure).
    LinkProfile("loopback-grpc", 10.0, 50e-6, efficiency=0.1, per_device=False,
                hardware=frozenset({"cpu-local"}), tier=1, source="memcpy bandwidth, 2-core host; gRPC copies"),
    # Same host, NIXL agents over UCX (hetserve's `nixl` transport; UCX picks sm/tcp on loopback): the decode
    # side READs from the prefill's registered staging buffer, one copy into it on the sender. Measured here at
    # ~0.8x `shm` (47 MB fp16 KV: 162 vs 204 MB/s on a loaded 2-core box); fit it with --measure-transports.
    LinkProfile("loopback-nixl", 10.0, 20e-6, efficiency=0.6, per_device=False,
                hardware=frozenset({"cpu-local"}), tier=1, source="memcpy bandwidth, 2-core host; UCX copies"),
    # Ethernet + kernel TCP: line rate less protocol and copy overhead.
    LinkProfile("tcp-10g", 10 * _GBIT, 50e-6, efficiency=0.7, per_device=False, tier=1,
                source="10 GbE line rate"),
    LinkProfile("tcp-25g", 25 * _GBIT, 40e-6, efficiency=0.7, per_device=False, tier=2,
                source="25 GbE line rate"),
    # PCIe: 16 lanes x 16 GT/s (Gen4) / 32 GT/s (Gen5) x 128b/130b = 31.5 / 63.0 GB/s each way.
    # A Gen5 link needs Gen5 devices at both ends; Gen5 devices also run at Gen4.
    LinkProfile("pcie-gen4-x16", 31.5, 5e-6, efficiency=0.8, kinds=_GPU,
                host_links=frozenset({"pcie-gen4-x16", "pcie-gen5-x16"}), tier=3, source="PCIe 4.0 spec"),
    LinkProfile("pcie-gen5-x16", 63.0, 5e-6, efficiency=0.8, kinds=_GPU,
                host_links=frozenset({"pcie-gen5-x16"}), tier=4, source="PCIe 5.0 spec"),
    # RDMA (InfiniBand / RoCE), one NIC per device as in DGX/HGX nodes.
    LinkProfile("rdma-100g", 100 * _GBIT, 5e-6, efficiency=0.9, tier=5, source="100 Gb/s HDR100/RoCE"),
    LinkProfile("rdma-200g", 200 * _GBIT, 5e-6, efficiency=0.9, tier=6, source="200 Gb/s HDR"),
    LinkProfile("rdma-400g", 400 * _GBIT, 5e-6, efficiency=0.9, tier=7, source="400 Gb/s NDR"),
    # NVLink 4 (H100/H200/H20): 900 GB/s total = 450 GB/s each way; prefill and decode GPUs must
    # sit in the same NVLink domain, i.e. be the same GPU type in one node.
    LinkProfile("nvlink", 450.0, 3e-6, efficiency=0.8, kinds=_GPU,
                hardware=frozenset({"h100", "h200", "h20"}), same_hardware=True, tier=8,
                source="NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional"),
)}


@dataclass(frozen=True)
class KVTier:
    """Where the decode instance keeps the KV cache it attends over.

    ``device`` uses device memory (bandwidth/capacity from the hardware profile); ``host`` uses host
    DRAM reached over the hardware's ``host_link``; the others use the fixed figures below.
    """

    name: str
    read_gbs: Optional[float] = None  # None: resolved from the hardware profile
    capacity_gb: Optional[float] = None  # per instance; None: resolved from the hardware profile
    latency_s: float = 0.0  # added to every decode step
    source: str = ""


KV_TIERS: dict[str, KVTier] = {t.name: t for t in (
    KVTier("device"),
    KVTier("host"),
    # One NVMe Gen4 x4 SSD: ~7 GB/s sequential read, 3.84 TB.
    KVTier("disk", read_gbs=7.0, capacity_gb=3840.0, latency_s=100e-6, source="NVMe Gen4 x4 SSD"),
    # Remote Redis over 25 GbE (~70% of line rate), sized at 512 GB per instance.
    KVTier("redis", read_gbs=25 * _GBIT * 0.7, capacity_gb=512.0, latency_s=200e-6,
           source="Redis over 25 GbE"),
)}


def lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    """Preset by name, case-insensitively (people write H100, L40S, Llama3-8B)."""
    if name in table:
        return table[name]
    folded = {k.casefold(): v for k, v in table.items()}
    try:
        return folded[str(name).strip().casefold()]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(table)}") from None


__all__ = [
    "PRECISIONS", "DTYPE_BYTES", "PRECISION_RANK", "PRECISION_FALLBACK", "check_precision",
    "ModelConfig", "MODELS", "HardwareProfile", "HARDWARE", "LinkProfile", "LINKS",
    "KVTier", "KV_TIERS", "lookup",
]

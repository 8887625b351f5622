"""The geometry of an SGLang file store (SGLang 0.5.23's ``HiCacheFile`` backend), as a user
states it: ``sglang-file:DIR?model=…&layers=…&kv_heads=…&head_dim=…&dtype=…&page_size=…&layout=…
&tp=…`` (docs/sglang-stores.md). :class:`Geometry` is a frozen value: the files of one page
(:meth:`Geometry.ranks`: name suffix, layers × kv-heads, size) and the byte order of each
(:meth:`Geometry.rows`). What a directory holds, and whether it matches, is
:mod:`engine.storage.sglang_store`.

Page files are ``{page_hash}{suffix}.bin``: ``_{model}_{tp_rank}_{tp_size}`` plus
``_{pp_size}_{pp_rank}`` with pipeline parallelism (MLA: ``_{model}`` and the PP part only; every
TP rank shares the file); in the unified key scheme ``_{digest}_L{a}-{b}[_H{g}]``. One page of
one rank, per host layout (``K`` = 2 kinds K and V, 1 for MLA; ``L`` the rank's layers, ``P``
the page size, ``H`` its kv-heads, each element a ``head_dim`` row): ``layer_first`` and
``page_first_direct`` ``[K, L, P, H]``; ``page_first`` ``[K, P, L, H]``; ``page_head``
``[K, H, P, L]`` (not for MLA); a unified-scheme object ``[L, K, P, H]``.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

import numpy as np

from engine.core.errors import UsageError

SCHEME = "sglang-file:"
SGLANG_VERSION = "0.5.23"
"""The SGLang release whose file names and page layouts this module follows."""

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
SCHEMES = ("legacy", "unified")
_ORDERS = {  # physical axis order of one page, as positions in (kinds, layers, tokens, heads)
    "layer_first": (0, 1, 2, 3),
    "page_first_direct": (0, 1, 2, 3),
    "page_first": (0, 2, 1, 3),
    "page_head": (0, 3, 2, 1),
    "page_unified": (1, 0, 2, 3),   # one object of the unified scheme: [L, K, P, H]
}
UNIFIED_OBJECT_LAYOUT = "page-unified-v1"
_TORCH_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
DTYPES = {"bf16": ("bfloat16", 2), "bfloat16": ("bfloat16", 2), "fp16": ("float16", 2),
          "float16": ("float16", 2), "fp32": ("float32", 4), "float32": ("float32", 4),
          "fp8_e4m3": ("fp8_e4m3", 1), "fp8_e5m2": ("fp8_e5m2", 1)}
"""dtype spellings: a name and its element size (fp8 only between SGLang stores)."""

FIELDS = ("model", "layers", "kv_heads", "head_dim", "dtype", "page_size", "layout", "tp",
          "pp", "pp_layers", "mla", "scheme", "head_group", "layer_partition")
REQUIRED = ("model", "layers", "kv_heads", "head_dim", "dtype", "page_size", "layout")
LIMITS = {"layers": 1024, "kv_heads": 1024, "head_dim": 1 << 16, "page_size": 1 << 16,
          "tp": 1024, "pp": 1024}
MAX_MODEL_CHARS = 200
MAX_PAGE_BYTES = 1 << 30
"""A page (every rank's part) larger than this is a mistyped geometry: a conversion holds one
page's files and its targets in memory at once per worker."""



def is_sglang(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(SCHEME)


def sg_model_name(name: str) -> str:
    """The model as SGLang spells it in file names (``/`` becomes ``-``)."""
    return "-".join(name.split("/"))


def sg_pp_range(layers: int, pp: int, rank: int, parts: tuple[int, ...] | None = None
                ) -> tuple[int, int]:
    """Layers of SGLang pipeline stage ``rank``: ``parts`` (its ``SGLANG_PP_LAYER_PARTITION``)
    or an even split with the *last* ``layers % pp`` stages one layer more (SGLang's rule;
    hicache's own gives the extra layers to the first stages)."""
    if parts is not None:
        start = sum(parts[:rank])
        return start, start + parts[rank]
    base, extra = divmod(layers, pp)
    if rank >= pp - extra:
        start = rank * (base + 1) - (pp - extra)
        return start, start + base + 1
    return rank * base, (rank + 1) * base


@dataclasses.dataclass(frozen=True)
class Rank:
    tp_rank: int | None            # None: MLA (every TP rank shares the file)
    pp_rank: int
    layers: tuple[int, int]
    heads: tuple[int, int]
    suffix: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What an SGLang store holds, as the user states it."""

    model: str                      # as in the file names
    layers: int
    kv_heads: int                   # total (MLA: 1)
    head_dim: int                   # MLA: the latent width (kv_lora_rank + rope dim)
    dtype: str
    page_size: int
    layout: str
    tp: int = 1
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None
    mla: bool = False
    scheme: str = "legacy"           # or "unified": SGLang 0.5.23's unified key scheme
    head_group: int | None = None    # unified: kv-heads per object (None: each rank's heads)
    layer_partition: int | None = None   # unified: layers per object (None: each stage's)

    @property
    def file_model(self) -> str:
        return sg_model_name(self.model)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def kinds(self) -> int:
        return 1 if self.mla else 2

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.itemsize

    def label(self) -> str:
        if self.scheme == "unified":
            s = f"sglang-unified:head_group={self.group() or '-'}"
            if self.layer_partition:
                s += f",layer_partition={self.layer_partition}"
            return s + (f",pp={self.pp}" if self.pp > 1 and not self.layer_partition else "") \
                + (",mla" if self.mla else "")
        s = f"sglang:{self.layout},tp={self.tp}"
        if self.pp > 1:
            s += f",pp={self.pp}"
        return s + (",mla" if self.mla else "")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pp_layers"] = list(self.pp_layers) if self.pp_layers else None
        return d

    def query(self) -> str:
        """The geometry as a ``sglang-file:`` query string."""
        d = {k: v for k, v in self.to_dict().items() if v not in (None, False)}
        if d.get("scheme") == "legacy":
            del d["scheme"]
        if d.get("pp_layers"):
            d["pp_layers"] = ",".join(map(str, d["pp_layers"]))
        if d.get("mla"):
            d["mla"] = 1
        return urllib.parse.urlencode(d, safe=",")

    def group(self) -> int:
        """Unified scheme: kv-heads per object (0 for MLA: no head axis)."""
        return 0 if self.mla else (self.head_group or self.kv_heads // self.tp)

    def digest(self) -> str:
        """The unified scheme's namespace digest (SGLang 0.5.23, schema 1): SHA-256 of the
        msgpack map of its namespace fields, in their declared order."""
        import hashlib

        fields = (("schema_version", 1), ("model_id", self.model),
                  ("dtype", _TORCH_NAMES[self.dtype_name]), ("page_size", self.page_size),
                  ("rank_replicated", self.mla),
                  ("total_kv_heads", 0 if self.mla else self.kv_heads),
                  ("layer_partition", self.layer_partition or 0),
                  ("head_group", self.group()), ("object_layout", UNIFIED_OBJECT_LAYOUT))
        raw = bytes([0x80 | len(fields)]) + b"".join(_msgpack(k) + _msgpack(v)
                                                     for k, v in fields)
        return f"ukv1-{hashlib.sha256(raw).hexdigest()[:16]}"

    def _unified_objects(self) -> list[Rank]:
        out, digest, g = [], self.digest(), self.group()
        for p in range(self.pp):
            s, e = sg_pp_range(self.layers, self.pp, p, self.pp_layers)
            lp = self.layer_partition
            chunks = [(s, e)] if not lp else [(a, min(a + lp, e)) for a in range(s, e, lp)]
            for a, b in chunks:
                if self.mla:
                    out.append(Rank(None, p, (a, b), (0, 1), f"_{digest}_L{a}-{b}",
                                    (b - a) * self.page_size * self.row_bytes))
                    continue
                for i in range(self.kv_heads // g):
                    out.append(Rank(None, p, (a, b), (i * g, (i + 1) * g),
                                    f"_{digest}_L{a}-{b}_H{i}",
                                    2 * (b - a) * self.page_size * g * self.row_bytes))
        return out

    def ranks(self) -> list[Rank]:
        """Every object of a page: one per writer (MLA: per PP stage), PP stages outer; in
        the unified scheme one per layer chunk x head group, whoever writes it."""
        if self.scheme == "unified":
            return self._unified_objects()
        out = []
        for p in range(self.pp):
            lr = sg_pp_range(self.layers, self.pp, p, self.pp_layers)
            pp_part = f"_{self.pp}_{p}" if self.pp > 1 else ""
            if self.mla:
                nb = (lr[1] - lr[0]) * self.page_size * self.row_bytes
                out.append(Rank(None, p, lr, (0, 1), f"_{self.file_model}{pp_part}", nb))
                continue
            for t in range(self.tp):
                if self.tp <= self.kv_heads:
                    n = self.kv_heads // self.tp
                    hr = (t * n, (t + 1) * n)
                else:               # more ranks than heads: each head on tp/heads ranks
                    h = t // (self.tp // self.kv_heads)
                    hr = (h, h + 1)
                nb = 2 * (lr[1] - lr[0]) * self.page_size * (hr[1] - hr[0]) * self.row_bytes
                out.append(Rank(t, p, lr, hr, f"_{self.file_model}_{t}_{self.tp}{pp_part}",
                                nb))
        return out

    def page_bytes(self) -> int:
        """Bytes of one page of the whole model (K and V, every layer and head)."""
        return self.kinds * self.layers * self.page_size * \
            (1 if self.mla else self.kv_heads) * self.row_bytes

    # -- one rank's page bytes <-> rows [layers, kinds, tokens, heads] --------------------------
    def _shape(self, r: Rank) -> tuple[int, int, int, int]:
        return (self.kinds, r.layers[1] - r.layers[0], self.page_size, r.heads[1] - r.heads[0])

    def rows(self, buf, r: Rank) -> np.ndarray:
        """``[layers, kinds, tokens, heads]`` rows (a view) of rank ``r``'s page bytes."""
        order = _ORDERS[self.layout]
        shape = self._shape(r)
        a = np.frombuffer(buf, dtype=np.dtype((np.void, self.row_bytes)))
        phys = a.reshape(tuple(shape[i] for i in order))
        # phys axis j holds logical axis order[j]; logical (k, l, t, h) -> our (l, k, t, h)
        inv = [order.index(i) for i in range(4)]
        return phys.transpose(inv).transpose(1, 0, 2, 3)


def _msgpack(v) -> bytes:
    """msgpack of a str, bool or non-negative int (the namespace digest's values)."""
    import struct

    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if v < 0x80:
            return bytes([v])
        for tag, fmt, top in ((0xcc, ">B", 0xff), (0xcd, ">H", 0xffff),
                              (0xce, ">I", 0xffffffff), (0xcf, ">Q", 1 << 64)):
            if v <= top:
                return bytes([tag]) + struct.pack(fmt, v)
    b = v.encode("utf-8")
    n = len(b)
    if n < 32:
        return bytes([0xa0 | n]) + b
    for tag, fmt, top in ((0xd9, ">B", 0xff), (0xda, ">H", 0xffff), (0xdb, ">I", 1 << 32)):
        if n <= top:
            return bytes([tag]) + struct.pack(fmt, n) + b
    raise ValueError("value too long")


def _int_field(name: str, raw: str, what: str) -> int:
    if not re.fullmatch(r"\d{1,7}", raw.strip()):
        raise UsageError(f"{what}: {name}={raw!r:.40} is not a whole number")
    v = int(raw)
    if v < 1 or v > LIMITS.get(name, 1 << 20):
        raise UsageError(f"{what}: {name}={v} is out of range (1..{LIMITS.get(name, 1 << 20)})")
    return v


def parse_spec(spec: str) -> tuple[str, dict]:
    """``sglang-file:DIR[?field=value&…]`` -> (DIR, the fields given, parsed and range-checked;
    UsageError naming the field otherwise)."""
    if not is_sglang(spec):
        raise UsageError(f"not an SGLang store address: {spec!r:.80} (sglang-file:DIR?…)")
    rest = spec[len(SCHEME):]
    path, _, q = rest.partition("?")
    if path.startswith("//"):
        path = path[2:]
    what = f"{SCHEME}{path}"
    if not path:
        raise UsageError(f"{SCHEME}: no directory given (sglang-file:DIR?model=…)")
    fields: dict = {}
    for part in q.split("&") if q else []:
        if not part:
            continue
        k, eq, v = part.partition("=")
        k = urllib.parse.unquote(k).strip()
        v = urllib.parse.unquote(v)
        if k not in FIELDS:
            raise UsageError(f"{what}: unknown geometry field {k!r:.40} (fields: "
                             f"{', '.join(FIELDS)})")
        if not eq:
            raise UsageError(f"{what}: field {k} has no value ({k}=…)")
        if k in fields:
            raise UsageError(f"{what}: field {k} is given twice")
        fields[k] = _parse_value(k, v, what)
    return path, fields


def _parse_value(k: str, v: str, what: str):
    if k == "model":
        name = sg_model_name(v.strip())
        if not name or len(name) > MAX_MODEL_CHARS or not name.isprintable() or \
                name in (".", "..") or "\\" in name:
            raise UsageError(f"{what}: model={v!r:.60} is not a model name as SGLang writes it "
                             f"in file names (1-{MAX_MODEL_CHARS} printable characters)")
        return v.strip()
    if k == "scheme":
        if v.strip() not in SCHEMES:
            raise UsageError(f"{what}: scheme={v!r:.40} is not one of {', '.join(SCHEMES)}")
        return v.strip()
    if k == "dtype":
        if v.strip().lower() not in DTYPES:
            raise UsageError(f"{what}: dtype={v!r:.40} is not one of "
                             f"{', '.join(sorted(set(DTYPES)))}")
        return v.strip().lower()
    if k == "layout":
        if v.strip() not in LAYOUTS:
            raise UsageError(f"{what}: layout={v!r:.40} is not one of {', '.join(LAYOUTS)} "
                             "(SGLang's --hicache-mem-layout)")
        return v.strip()
    if k == "layer_partition" and v.strip() == "0":
        return None
    if k == "mla":
        if v.strip().lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise UsageError(f"{what}: mla={v!r:.20} is not 0 or 1")
        return v.strip().lower() in ("1", "true", "yes")
    if k == "pp_layers":
        parts = v.split(",")
        if len(parts) > LIMITS["pp"]:
            raise UsageError(f"{what}: pp_layers has more than {LIMITS['pp']} stages")
        return tuple(_int_field("pp_layers", p, what) for p in parts)
    return _int_field(k, v, what)


def geometry(fields: dict, what: str, base: Geometry | None = None,
             fixed: tuple[str, ...] = ()) -> Geometry:
    """A checked :class:`Geometry` from parsed fields; ``base`` fills the fields not given
    (a destination takes the source's), and ``fixed`` names fields that must equal ``base``'s
    (a conversion never changes the model's KV). UsageError naming the field otherwise."""
    d = dict(fields)
    if base is not None:
        for k in fixed:
            if k in d and d[k] != getattr(base, k) and \
                    not (k == "dtype" and DTYPES[d[k]][0] == base.dtype_name):
                raise UsageError(f"{what}: {k}={d[k]} differs from the source's "
                                 f"{k}={getattr(base, k)} (a conversion never changes a model's "
                                 "KV; only model, layout, tp, pp and pp_layers may change)")
        keep = {k: getattr(base, k) for k in FIELDS if k not in d}
        if "pp" in d and "pp_layers" not in d:
            keep.pop("pp_layers", None)
        if d.get("scheme", base.scheme) != base.scheme or "tp" in d:
            keep.pop("head_group", None)        # another scheme or shape: its own grid
            keep.pop("layer_partition", None)
        if d.get("scheme", base.scheme) != base.scheme:
            keep.pop("layout", None)
        d = {**keep, **d}
    if d.get("scheme") == "unified":
        if d.get("layout", "page_unified") != "page_unified":
            raise UsageError(f"{what}: layout={d['layout']} with scheme=unified (its objects "
                             "are page_unified chunks; leave layout out)")
        d["layout"] = "page_unified"
    elif d.get("layout") == "page_unified":
        raise UsageError(f"{what}: layout=page_unified is the unified scheme's (give "
                         "scheme=unified, or a legacy host layout)")
    elif d.get("head_group") or d.get("layer_partition"):
        raise UsageError(f"{what}: head_group and layer_partition are unified-scheme fields "
                         "(give scheme=unified)")
    missing = [k for k in REQUIRED if k not in d]
    if d.get("mla") and "kv_heads" in missing:
        missing.remove("kv_heads")
        d["kv_heads"] = 1
    if missing:
        raise UsageError(f"{what}: geometry field {missing[0]} is missing (an SGLang store's "
                         "files do not record it; give model, layers, kv_heads, head_dim, "
                         "dtype, page_size, layout and tp in the address, e.g. "
                         f"{SCHEME}DIR?model=M&layers=32&kv_heads=8&head_dim=128&dtype=bf16"
                         "&page_size=64&layout=page_first&tp=2)")
    g = Geometry(**{k: d[k] for k in FIELDS if k in d})
    if g.mla and g.kv_heads != 1:
        raise UsageError(f"{what}: kv_heads={g.kv_heads} with mla=1 (an MLA store holds one "
                         "latent vector per token: kv_heads=1, head_dim = its width)")
    if g.mla and g.layout == "page_head":
        raise UsageError(f"{what}: layout=page_head does not exist for MLA in SGLang")
    if not g.mla and g.kv_heads % g.tp and g.tp % g.kv_heads:
        raise UsageError(f"{what}: tp={g.tp} cannot split kv_heads={g.kv_heads} (tp must divide "
                         "the kv-heads or be a multiple of them)")
    if g.pp > g.layers:
        raise UsageError(f"{what}: pp={g.pp} is more stages than layers={g.layers}")
    if g.pp_layers is not None and (len(g.pp_layers) != g.pp or sum(g.pp_layers) != g.layers):
        raise UsageError(f"{what}: pp_layers={','.join(map(str, g.pp_layers))} must give pp="
                         f"{g.pp} stage sizes summing to layers={g.layers}")
    if g.pp_layers is not None and g.pp == 1:
        g = dataclasses.replace(g, pp_layers=None)
    if g.page_bytes() > MAX_PAGE_BYTES:
        raise UsageError(f"{what}: one page of this geometry is {g.page_bytes():,} bytes (at "
                         f"most {MAX_PAGE_BYTES:,}): check layers, kv_heads, head_dim and "
                         "page_size")
    if g.scheme == "unified":
        check_unified(g, what)
    return g


def check_unified(g: Geometry, what: str) -> None:
    """The grid rules of SGLang 0.5.23's unified scheme (``plan_unified_kv``)."""
    if g.mla:
        if g.head_group:
            raise UsageError(f"{what}: head_group with mla=1 (MLA objects have no head axis)")
    else:
        if g.tp > g.kv_heads:
            raise UsageError(f"{what}: tp={g.tp} > kv_heads={g.kv_heads}: the unified scheme "
                             "cannot name replicated heads")
        local = g.kv_heads // g.tp
        if g.head_group is None and local == 1 and g.tp > 1:
            raise UsageError(f"{what}: head_group is missing (at one kv-head per rank SGLang "
                             "needs it stated: head_group=1)")
        if g.head_group is not None and (local % g.head_group or g.head_group > local):
            raise UsageError(f"{what}: head_group={g.head_group} must divide each rank's "
                             f"{local} kv-heads (kv_heads={g.kv_heads} / tp={g.tp})")
    lp = g.layer_partition
    for p in range(g.pp) if lp else ():
        s, e = sg_pp_range(g.layers, g.pp, p, g.pp_layers)
        if s % lp or (e % lp and p != g.pp - 1):
            raise UsageError(f"{what}: layer_partition={lp} does not fit pipeline stage {p} "
                             f"(layers {s}-{e}): stages must start, and all but the last end, "
                             "on a multiple of it")



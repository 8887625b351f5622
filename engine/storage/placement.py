"""Where the bytes of a page go in the store: the unified grid or the legacy per-rank layout.

**Unified** (the default): the whole model's page is cut by a fleet-wide :class:`Grid` into
rectangles of ``layers`` consecutive layers × ``heads`` consecutive kv-heads (MLA: layers only);
each rectangle of each page is one object, K and V both. A writer stores the rectangles that lie
inside its shard; a reader fetches every rectangle that overlaps its shard in one batched get and
keeps its part (a reader shard that cuts through a rectangle reads the whole rectangle and slices
it). A *writer* whose shard cuts a rectangle is refused up front: it does not hold all of its
bytes.

**Legacy**: one object per rank per page, the rank in the key (how per-rank stores such as
SGLang's file backend work). Only the same rank of the same deployment shape can read it back;
``hicache convert-layout`` migrates such stores.

The namespace of every key hashes the model id, the scheme, the grid (or TP/PP sizes) and the
payload order, so readers configured differently miss instead of misreading. Every object's
header repeats all of it (``store`` entry of the layout description), which is what makes a store
self-describing for ``convert-layout``.

Payload orders (:class:`KVOrder`): ``layer_first`` is ``[layers, kv_kinds, page_size, heads,
head_dim]`` — a slice of a host pool page, what the L3 store reads and writes; ``page_first`` is
``[page_size, layers, kv_kinds, heads, head_dim]`` (token-major), readable only after conversion.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from engine.core.choices import Choice
from engine.core.layout import KVLayout
from engine.storage.config import StorageLayout  # noqa: F401 - re-exported (its home is light)
from engine.storage.keys import legacy_coordinate, namespace_id, unified_coordinate


class KVOrder(Choice):
    __what__ = "payload order"

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"


DEFAULT_FLEET_TP = 8
DEFAULT_FLEET_PP = 2


@dataclasses.dataclass(frozen=True)
class Grid:
    """The fleet's cut of a page: ``layers`` per layer chunk, ``heads`` per kv-head group."""

    layers: int
    heads: int

    def __post_init__(self) -> None:
        if self.layers < 1 or self.heads < 1:
            raise ValueError(f"grid sizes must be >= 1, got layers={self.layers}, "
                             f"heads={self.heads}")

    @classmethod
    def default(cls, model: KVLayout) -> "Grid":
        """Fine enough for any fleet up to TP8 × PP2: ``ceil(layers / 2)`` layers ×
        ``max(1, kv_heads / 8)`` heads."""
        return cls.for_shape(model, DEFAULT_FLEET_TP, DEFAULT_FLEET_PP)

    @classmethod
    def for_shape(cls, model: KVLayout, tp: int, pp: int) -> "Grid":
        L, H = model.model_layers, model.model_kv_heads
        return cls(max(1, math.ceil(L / max(1, pp))), max(1, H // max(1, tp)))

    @classmethod
    def parse(cls, spec: "str | None", model: KVLayout) -> "Grid":
        """``None``/``""``/``default``; ``layers=8,heads=2``; or ``tp=4,pp=2`` (the finest
        deployment shape of the fleet). ``ValueError`` with the valid forms otherwise."""
        if spec is None or spec.strip() in ("", "default"):
            return cls.default(model)
        check_grid_spec(spec)
        kv = _parse_kv(spec, {"layers", "heads", "tp", "pp"}, "grid")
        if {"tp", "pp"} & kv.keys():
            return cls.for_shape(model, kv.get("tp", 1), kv.get("pp", 1))
        d = cls.default(model)
        return cls(kv.get("layers", d.layers), kv.get("heads", d.heads))

    def cells(self, model: KVLayout) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Every rectangle of the whole model, layer chunks outer, head groups inner."""
        L, H = model.model_layers, model.model_kv_heads
        hs = [(0, 1)] if model.kv_kinds == 1 else \
            [(h, min(h + self.heads, H)) for h in range(0, H, self.heads)]
        return [((lo, min(lo + self.layers, L)), h) for lo in range(0, L, self.layers)
                for h in hs]


def check_grid_spec(spec: "str | None") -> None:
    """``ValueError`` for a grid spec :meth:`Grid.parse` would refuse (checked before any
    model is known)."""
    if spec is not None and spec.strip() not in ("", "default"):
        kv = _parse_kv(spec, {"layers", "heads", "tp", "pp"}, "grid")
        if {"layers", "heads"} & kv.keys() and {"tp", "pp"} & kv.keys():
            raise ValueError(f"grid {spec!r}: give layers=/heads= or tp=/pp=, not both")


def _parse_kv(spec: str, allowed: set[str], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if not m or m.group(1) not in allowed or int(m.group(2)) < 1:
            raise ValueError(f"bad {what} {spec!r}: expected comma-separated "
                             f"{'/'.join(sorted(allowed))}=N (N >= 1)")
        out[m.group(1)] = int(m.group(2))
    return out


@dataclasses.dataclass(frozen=True)
class Tile:
    """One object of a page: its rectangle, key suffix and the layout its header carries."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    suffix: str
    layout: KVLayout
    description: dict[str, Any]

    @property
    def payload_len(self) -> int:
        return self.layout.page_bytes


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _inside(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return b[0] <= a[0] and a[1] <= b[1]


def span(layout: KVLayout) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (layers, heads) ranges ``layout`` covers in the whole model."""
    return ((layout.layer_start, layout.layer_start + layout.num_layers),
            (layout.head_start, layout.head_start + layout.kv_heads))


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a store lays pages out. ``grid`` is a spec for :meth:`Grid.parse` (unified);
    ``tp``/``pp`` are ``(rank, size)`` of the writer/reader (legacy keys carry them)."""

    scheme: StorageLayout = StorageLayout.UNIFIED
    grid: str | None = None
    kv_order: KVOrder = KVOrder.LAYER_FIRST
    tp: tuple[int, int] = (0, 1)
    pp: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", StorageLayout.parse(self.scheme))
        object.__setattr__(self, "kv_order", KVOrder.parse(self.kv_order))
        for name in ("tp", "pp"):
            r, n = getattr(self, name)
            if not (n >= 1 and 0 <= r < n):
                raise ValueError(f"{name} rank {r} of {n} is impossible")

    @classmethod
    def parse_target(cls, spec: str) -> "Placement":
        """``unified``, ``unified:layers=8,heads=2``, ``unified:tp=4,pp=2``, ``legacy:tp=2,pp=1``
        (every rank of that shape), optionally ``+page_first``/``+layer_first`` at the end."""
        s, order = spec.strip(), KVOrder.LAYER_FIRST
        if "+" in s:
            s, _, o = s.rpartition("+")
            order = KVOrder.parse(o)
        scheme, _, rest = s.partition(":")
        try:
            kind = StorageLayout.parse(scheme)
        except ValueError:
            raise ValueError(f"unknown layout {spec!r}: expected unified[:layers=N,heads=N] or "
                             "legacy:tp=N,pp=N (optionally +page_first)") from None
        if kind is StorageLayout.UNIFIED:
            if rest:
                check_grid_spec(rest)
            return cls(kind, rest or None, order)
        kv = _parse_kv(rest, {"tp", "pp"}, "legacy shape") if rest else {}
        return cls(kind, None, order, (0, kv.get("tp", 1)), (0, kv.get("pp", 1)))

    def ranks(self) -> list["Placement"]:
        """Legacy: one placement per rank of this shape; unified: itself."""
        if self.scheme is StorageLayout.UNIFIED:
            return [self]
        return [dataclasses.replace(self, tp=(t, self.tp[1]), pp=(p, self.pp[1]))
                for p in range(self.pp[1]) for t in range(self.tp[1])]

    def label(self, model: KVLayout) -> str:
        if self.scheme is StorageLayout.LEGACY:
            base = f"legacy:tp={self.tp[1]},pp={self.pp[1]}"
        else:
            g = Grid.parse(self.grid, model)
            base = f"unified:layers={g.layers},heads={g.heads}"
        return base if self.kv_order is KVOrder.LAYER_FIRST else f"{base}+{self.kv_order.value}"

    # -- keys and tiles ----------------------------------------------------------------------
    def storage_fields(self, model: KVLayout) -> dict[str, Any]:
        """What the namespace hashes and every header repeats (besides the model)."""
        d: dict[str, Any] = {"scheme": self.scheme.value, "kv_order": self.kv_order.value}
        if self.scheme is StorageLayout.UNIFIED:
            g = Grid.parse(self.grid, model)
            d["grid"] = [g.layers, g.heads]
        else:
            d["shape"] = [self.tp[1], self.pp[1]]
        return d

    def namespace(self, model: KVLayout, model_tag: str = "") -> str:
        return namespace_id(model.whole(), model_tag, **self.storage_fields(model))

    def tile_at(self, model: KVLayout, ns: str, layers: tuple[int, int],
                heads: tuple[int, int], tag: str) -> Tile:
        """The object holding ``layers`` × ``heads`` of a page (``ns``: :meth:`namespace`)."""
        lay = model.region(layers, heads)
        if self.scheme is StorageLayout.LEGACY:
            suffix = legacy_coordinate(ns, self.tp, self.pp)
        else:
            suffix = unified_coordinate(ns, layers, None if model.kv_kinds == 1 else heads)
        store = {**self.storage_fields(model), "tag": tag}
        if self.scheme is StorageLayout.LEGACY:
            store["rank"] = [self.tp[0], self.pp[0]]
        return Tile(layers, heads, suffix, lay, {**lay.to_dict(), "store": store})

    def all_tiles(self, model: KVLayout, model_tag: str = "") -> list[Tile]:
        """Every object of one page in this placement (legacy: every rank's)."""
        ns = self.namespace(model, model_tag)
        if self.scheme is StorageLayout.LEGACY:
            out = []
            for p in self.ranks():
                sh = span(model.shard(p.tp[1], p.tp[0], p.pp[1], p.pp[0]))
                out.append(p.tile_at(model, ns, sh[0], sh[1], model_tag))
            return out
        return [self.tile_at(model, ns, lr, hr, model_tag)
                for lr, hr in Grid.parse(self.grid, model).cells(model)]

    def tiles(self, shard: KVLayout, model_tag: str = "", *, writing: bool) -> list[Tile]:
        """The objects of one page that ``shard`` reads (every object overlapping it) or writes
        (the same, each of which must lie inside it: ``ValueError`` otherwise)."""
        layers, heads = span(shard)
        if self.scheme is StorageLayout.LEGACY:
            own = span(shard.shard(self.tp[1], self.tp[0], self.pp[1], self.pp[0]))
            if own != (layers, heads):
                raise ValueError(
                    f"legacy layout: rank tp {self.tp[0]}/{self.tp[1]}, pp {self.pp[0]}/"
                    f"{self.pp[1]} holds layers {own[0]} × heads {own[1]}, not the pool's "
                    f"layers {layers} × heads {heads}")
            return [self.tile_at(shard, self.namespace(shard, model_tag), layers, heads,
                               model_tag)]
        out = [t for t in self.all_tiles(shard, model_tag)
               if _overlaps(t.layers, layers) and _overlaps(t.heads, heads)]
        if writing:
            for t in out:
                if not (_inside(t.layers, layers) and _inside(t.heads, heads)):
                    g = Grid.parse(self.grid, shard)
                    raise ValueError(
                        f"this shard (layers {layers[0]}-{layers[1]}, kv-heads {heads[0]}-"
                        f"{heads[1]}) cuts the storage grid (layers={g.layers}, heads={g.heads})"
                        f" at layers {t.layers[0]}-{t.layers[1]} × heads {t.heads[0]}-"
                        f"{t.heads[1]}: it cannot write that object; choose a grid whose "
                        "cells fit every writer's shard (e.g. --hicache-storage-grid "
                        "tp=<largest TP>,pp=<largest PP>)")
        return out


class MalformedDescription(ValueError):
    """An object header's layout description that claims to be one of ours but does not hold
    together (a field of the wrong type or out of range): a damaged or crafted object."""


def describe_object(description: dict[str, Any]) -> tuple[KVLayout, Placement, str]:
    """Back from an object header's layout description to (its region, the placement that
    wrote it, the model tag); ``ValueError`` when it is not one of ours
    (:class:`MalformedDescription` when it claims to be but does not hold together)."""
    d = dict(description)
    store = d.pop("store", None)
    if not isinstance(store, dict):
        raise ValueError("the object's header does not say how the store is laid out "
                         "(written before the unified layout?)")
    try:
        layout = KVLayout.from_dict(d)
        layout.whole()                      # the region lies inside the model it names
        scheme = StorageLayout.parse(store["scheme"])
        order = KVOrder.parse(store["kv_order"])
        tag = store.get("tag", "")
        if not isinstance(tag, str):
            raise ValueError(f"model tag {tag!r:.40} is not a string")
        if scheme is StorageLayout.UNIFIED:
            gl, gh = (_int(x) for x in store["grid"])
            place = Placement(scheme, f"layers={gl},heads={gh}", order)
        else:
            tp_n, pp_n = (_int(x) for x in store["shape"])
            tp_r, pp_r = (_int(x) for x in store["rank"])
            place = Placement(scheme, None, order, (tp_r, tp_n), (pp_r, pp_n))
    except (KeyError, TypeError, ValueError) as e:
        raise MalformedDescription(f"the object's layout description is malformed ({e})") \
            from None
    return layout, place, tag


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{x!r:.40} is not an integer")
    return x

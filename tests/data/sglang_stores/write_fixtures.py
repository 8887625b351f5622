#!/usr/bin/env python
"""Write the committed SGLang store fixtures (tests/data/sglang_stores/*/) with SGLang's own
classes, on CPU. Needs SGLang installed (written with sglang 0.5.23 and torch 2.13 CPU; no
sgl_kernel). The tests only read the result; they never need SGLang.

    python tests/data/sglang_stores/write_fixtures.py [OUTDIR]

Per store and per simulated rank, every step that decides a byte or a file name is SGLang's:
its device pool (``MHATokenToKVPool`` on ``cpu``) is filled with known values; its host pool
(``MHATokenToKVPoolHost``, the store's host layout) takes them through its own
``backup_from_device_all_layer`` dispatch; its controller's ``_generic_page_set`` writes each
page through the ``file`` backend (``HiCacheFile``) made by its ``StorageBackendFactory``, and
the page keys come from its ``get_storage_hash_str``. What is not SGLang's: the four element
copies below, which stand in for the sgl_kernel CUDA copy ops a CPU install lacks (the host
pool calls them with tables of data pointers; they copy the same elements the kernels would).

Known values (exact in fp16, bf16 and fp32): element (layer, kind, position, head, dim) of the
whole model is ``(1 - 2*kind) * (1 + m/64) * 2**(position % 8 - 4)`` with
``m = (dim + 3*head + 17*layer + 5*(position // 8)) % 64`` — see :func:`known`.
Token ids: ``(37*i + 11) % 250`` (inside every hicache preset's vocabulary).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
import warnings

sys.dont_write_bytecode = True
os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(layers=2, kv_heads=2, head_dim=8, page_size=4, pages=3)
MLA = dict(layers=2, kv_heads=1, head_dim=16, kv_lora_rank=12, rope_dim=4, page_size=4,
           pages=3)                    # an MLA store: one latent row of 12 + 4 per token
TINY = dict(layers=4, kv_heads=2, head_dim=64, page_size=4, pages=3)   # hicache's "tiny"
STORES = (
    [dict(name=f"{lay}-tp{tp}-{dt}", layout=lay, tp=tp, dtype=dt, **SMALL)
     for lay in ("layer_first", "page_first", "page_first_direct", "page_head")
     for tp in (1, 2) for dt in ("bf16", "fp16")]
    + [dict(name="page_first-tp1-pp2-bf16", layout="page_first", tp=1, pp=2, dtype="bf16",
            **SMALL),
       dict(name="layer_first-tp2-pp2-bf16", layout="layer_first", tp=2, pp=2, dtype="bf16",
            **SMALL),
       dict(name="page_first-tp1-bf16-ns", layout="page_first", tp=1, dtype="bf16",
            extra_key="tenant-a", **SMALL),
       dict(name="page_first-tp2-bf16-ns", layout="page_first", tp=2, dtype="bf16",
            extra_key="tenant-a", **SMALL),
       dict(name="tiny-page_head-tp2-fp32", layout="page_head", tp=2, dtype="fp32",
            model="tiny-sglang", **TINY)]
    + [dict(name=f"mla-{lay}-bf16", layout=lay, tp=2, dtype="bf16", mla=True, **MLA)
       for lay in ("layer_first", "page_first", "page_first_direct")]
    + [dict(name="mla-page_first-pp2-bf16", layout="page_first", tp=1, pp=2, dtype="bf16",
            mla=True, **MLA)]
    + [dict(name="unified-hg1-tp1-bf16", scheme="unified", tp=1, head_group=1, dtype="bf16",
            **SMALL),
       dict(name="unified-hg1-tp2-bf16", scheme="unified", tp=2, head_group=1, dtype="bf16",
            **SMALL),
       dict(name="unified-tp1-fp16", scheme="unified", tp=1, dtype="fp16", **SMALL),
       dict(name="unified-hg1-lp1-tp2-fp16", scheme="unified", tp=2, head_group=1,
            layer_partition=1, dtype="fp16", **SMALL)]
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODEL = "fixture/small"          # SGLang writes it "fixture-small" in file names


def token_ids(n: int) -> list[int]:
    return [(37 * i + 11) % 250 for i in range(n)]


def known(layers, kind: int, positions, heads, head_dim: int) -> torch.Tensor:
    """float32 [len(layers), len(positions), len(heads), head_dim] of the known function."""
    lay = torch.tensor(list(layers)).view(-1, 1, 1, 1)
    pos = torch.tensor(list(positions)).view(1, -1, 1, 1)
    hd = torch.tensor(list(heads)).view(1, 1, -1, 1)
    dim = torch.arange(head_dim).view(1, 1, 1, -1)
    m = (dim + 3 * hd + 17 * lay + 5 * (pos // 8)) % 64
    v = (1 + m / 64.0) * torch.pow(2.0, (pos % 8 - 4).to(torch.float32))
    return (v if kind == 0 else -v).to(torch.float32)


# -- stand-ins for the sgl_kernel copy ops (element copies only) ---------------------------------
_TABLES: dict[tuple, list] = {}


def _tensors(table):
    if isinstance(table, torch.Tensor) and table.dtype == torch.uint64:
        return _TABLES[tuple(int(x) for x in table.tolist())]
    return list(table)


def _remember(ptrs, tensors) -> None:
    if ptrs is not None:
        _TABLES[tuple(int(x) for x in ptrs.tolist())] = list(tensors)


def _copy_lf(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices,
             dst_indices, **_):
    for s_tab, d_tab in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for s, d in zip(_tensors(s_tab), _tensors(d_tab)):
            d[dst_indices] = s[src_indices]


def _copy_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, **_):
    for s_tab, d in ((src_k_layers, dst_k), (src_v_layers, dst_v)):     # d: [tok, L, H, D]
        for layer, s in enumerate(_tensors(s_tab)):
            d[dst_indices, layer] = s[src_indices]


def _copy_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                page_size, **_):
    page, off = dst_indices // page_size, dst_indices % page_size
    for s_tab, d in ((src_k_layers, dst_k), (src_v_layers, dst_v)):     # d: [pg, H, ps, L, D]
        for layer, s in enumerate(_tensors(s_tab)):
            d[page, :, off, layer] = s[src_indices]


def _copy_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, **_):
    src, dst = _tensors(src_ptrs), _tensors(dst_ptrs)
    per = len(src) // len(dst)                  # the K layers, then the V layers
    page, off = dst_indices // page_size, dst_indices % page_size
    for kind, d in enumerate(dst):              # d: [pg, L, ps, H, D]
        for layer in range(per):
            d[page, layer, off] = src[kind * per + layer][src_indices]


def _copy_mla_lf(src_layers, dst_layers, src_indices, dst_indices, **_):
    for s, d in zip(_tensors(src_layers), _tensors(dst_layers)):
        d[dst_indices] = s[src_indices]


def _copy_mla_lf_pf(src_layers, dst, src_indices, dst_indices, **_):
    for layer, s in enumerate(_tensors(src_layers)):             # dst: [tok, L, 1, D]
        dst[dst_indices, layer] = s[src_indices]


def install_copies() -> None:
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    for mod, name, fn in ((mha, "transfer_kv_all_layer", _copy_lf),
                          (mha, "transfer_kv_all_layer_lf_pf", _copy_lf_pf),
                          (mha, "transfer_kv_all_layer_lf_ph", _copy_lf_ph),
                          (mha, "transfer_kv_all_layer_direct_lf_pf", _copy_direct_lf_pf),
                          (mla, "transfer_kv_all_layer_mla", _copy_mla_lf),
                          (mla, "transfer_kv_all_layer_mla_lf_pf", _copy_mla_lf_pf),
                          (mla, "transfer_kv_all_layer_direct_lf_pf", _copy_direct_lf_pf)):
        if not hasattr(mod, name):
            setattr(mod, name, fn)


def mla_pools(spec: dict, n: int, layers: int, dtype):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    ps = spec["page_size"]
    dev = MLATokenToKVPool(size=n + 2 * ps, page_size=ps, dtype=dtype,
                           kv_lora_rank=spec["kv_lora_rank"], qk_rope_head_dim=spec["rope_dim"],
                           layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(1 << 32):
        host = MLATokenToKVPoolHost(
            info, host_to_device_ratio=2.0, host_size=0, page_size=ps, layout=spec["layout"],
            pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
            end_layer=layers, target_layer_num=layers)
    _remember(host.device_data_ptrs, host.device_kv_buffers)
    if getattr(host, "data_ptrs", None) is not None:
        _remember(host.data_ptrs, host.data_refs)
    return dev, host


# -- one store -----------------------------------------------------------------------------------
def sg_pp_range(layers: int, pp: int, rank: int) -> tuple[int, int]:
    from sglang.srt.distributed.utils import get_pp_indices

    return get_pp_indices(layers, rank, pp)


def write_store(spec: dict, out: str) -> dict:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tp, pp, ps = spec["tp"], spec.get("pp", 1), spec["page_size"]
    dtype, n = DTYPES[spec["dtype"]], spec["pages"] * spec["page_size"]
    mla = spec.get("mla", False)
    heads_each = 1 if mla else spec["kv_heads"] // tp
    tokens = token_ids(n)
    key = types.SimpleNamespace(extra_key=spec.get("extra_key"), cache_salt=None)

    class Ids(list):                            # token ids carrying the request namespace
        pass

    ids = Ids(tokens)
    ids.extra_key, ids.cache_salt = key.extra_key, key.cache_salt
    keys = get_storage_hash_str(ids, None, page_size=ps)
    os.makedirs(out, exist_ok=True)
    for p in range(pp):
        l0, l1 = sg_pp_range(spec["layers"], pp, p)
        for t in range(1 if mla else tp):       # MLA: every TP rank writes the same file
            if mla:
                dev, host = mla_pools(spec, n, l1 - l0, dtype)
            else:
                dev = MHATokenToKVPool(size=n + 2 * ps, page_size=ps, dtype=dtype,
                                       head_num=heads_each, head_dim=spec["head_dim"],
                                       layer_num=l1 - l0, device="cpu",
                                       enable_memory_saver=False)
                info = dev.get_device_pool_infos()[0].buffer_info
                with host_memory_budget_scope(1 << 32):
                    host = MHATokenToKVPoolHost(
                        info, host_to_device_ratio=2.0, host_size=0, page_size=ps,
                        layout=spec["layout"], pin_memory=False, device="cpu",
                        device_capacity_tokens=dev.size, start_layer=0, end_layer=l1 - l0)
                _remember(dev.k_data_ptrs, dev.k_buffer)
                _remember(dev.v_data_ptrs, dev.v_buffer)
                for ptrs, refs in ((getattr(host, "k_data_ptrs", None),
                                    getattr(host, "k_data_refs", None)),
                                   (getattr(host, "v_data_ptrs", None),
                                    getattr(host, "v_data_refs", None))):
                    if ptrs is not None and refs is not None:
                        _remember(ptrs, refs)
            dev_idx = torch.arange(ps, ps + n, dtype=torch.int64)
            host.alloc(ps)                      # host pages do not start at 0
            host_idx = host.alloc(n)
            heads = range(t * heads_each, (t + 1) * heads_each)
            kinds = ((0, dev.kv_buffer),) if mla else ((0, dev.k_buffer), (1, dev.v_buffer))
            for kind, bufs in kinds:
                vals = known(range(l0, l1), kind, range(n), heads, spec["head_dim"]).to(dtype)
                for i in range(l1 - l0):
                    bufs[i][dev_idx] = vals[i]
            io = "direct" if spec["layout"] == "page_first_direct" else "kernel"
            host.backup_from_device_all_layer(dev, host_idx, dev_idx, io)
            cfg = HiCacheStorageConfig(
                tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=mla, enable_storage_metrics=False,
                is_page_first_layout=spec["layout"] == "page_first",
                model_name=spec.get("model", MODEL), extra_config={"file_storage_path": out})
            backend = StorageBackendFactory.create_backend("file", cfg, host)
            backend.register_mem_pool_host(host)
            ctrl = types.SimpleNamespace(storage_host_pool=host, page_size=ps,
                                         storage_backend=backend)
            if not HiCacheController._generic_page_set(ctrl, keys, host_idx):
                raise SystemExit(f"{spec['name']}: rank tp{t} pp{p}: the page set failed")
    import sglang

    meta = {**{k: v for k, v in spec.items() if k != "name"},
            "model": spec.get("model", MODEL), "sglang_version": sglang.__version__,
            "torch_version": torch.__version__, "token_ids": tokens, "page_hashes": keys,
            "files": sorted(f for f in os.listdir(out) if f.endswith(".bin"))}
    with open(os.path.join(out, "fixture.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


def write_unified(spec: dict, out: str) -> dict:
    """SGLang 0.5.23's unified key scheme, from its own parts: ``plan_unified_kv`` names the
    objects (namespace digest, absolute layer range, head group), ``PageUnifiedLayout`` places
    them in a ``page_unified`` host page block, ``HiCacheFile.set`` writes them. 0.5.23 has no
    device-to-host copy for ``page_unified`` and does not connect the scheme to its runtime,
    so the block is filled here in the order ``PageUnifiedLayout.page_dims`` documents, and the
    backend's rank suffix is set to "" (the scheme replaces it)."""
    from sglang.srt.mem_cache.hicache_key_scheme import normalize_dtype, plan_unified_kv
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.page_unified import PageUnifiedLayout
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tp, ps, L, D = spec["tp"], spec["page_size"], spec["layers"], spec["head_dim"]
    dtype, n = DTYPES[spec["dtype"]], spec["pages"] * spec["page_size"]
    local = spec["kv_heads"] // tp
    tokens = token_ids(n)
    keys = get_storage_hash_str(tokens, None, page_size=ps)
    os.makedirs(out, exist_ok=True)
    for t in range(tp):
        plan = plan_unified_kv(
            model_id=MODEL, dtype=normalize_dtype(dtype), page_size=ps, rank_replicated=False,
            local_kv_heads=local, attn_tp_rank=t, attn_tp_size=tp, attn_cp_size=1,
            start_layer=0, end_layer=L, is_final_stage=True,
            head_group=spec.get("head_group"), layer_partition=spec.get("layer_partition"))
        pul = PageUnifiedLayout(page_size=ps, layer_num=L, head_num=local,
                                head_group_num=plan.head_group_num, head_dim=D,
                                itemsize=dtype.itemsize)
        cfg = HiCacheStorageConfig(
            tp_rank=t, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name=MODEL, extra_config={"file_storage_path": out})
        backend = StorageBackendFactory.create_backend("file", cfg, None)
        backend.config_suffix = backend.tp_config_suffix = ""
        for p, key in enumerate(keys):
            block = torch.empty(pul.page_dims(1)[1:], dtype=dtype)   # [G, L, 2, ps, Hg, D]
            for g in range(plan.head_group_num):
                h0 = t * local + g * pul.heads_per_group
                for kind in (0, 1):
                    block[g, :, kind] = known(range(L), kind, range(p * ps, (p + 1) * ps),
                                              range(h0, h0 + pul.heads_per_group), D).to(dtype)
            flat = block.reshape(-1).view(torch.uint8)
            for j, suffix in enumerate(plan.suffixes):
                li, g = divmod(j, plan.head_group_num)
                off, ln = pul.chunk_span(plan.layer_ranges[li], g)
                if not backend.set(f"{key}_{suffix}", flat[off:off + ln]):
                    raise SystemExit(f"{spec['name']}: HiCacheFile.set failed")
    import sglang

    meta = {**{k: v for k, v in spec.items() if k != "name"}, "model": MODEL,
            "sglang_version": sglang.__version__, "torch_version": torch.__version__,
            "token_ids": tokens, "page_hashes": keys, "namespace_fields": {
                f: getattr(plan.namespace, f) for f in plan.namespace.__struct_fields__},
            "files": sorted(f for f in os.listdir(out) if f.endswith(".bin"))}
    with open(os.path.join(out, "fixture.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else HERE
    install_copies()
    for spec in STORES:
        out = os.path.join(root, spec["name"])
        shutil.rmtree(out, ignore_errors=True)
        meta = (write_unified if spec.get("scheme") == "unified" else write_store)(spec, out)
        print(f"{spec['name']}: {len(meta['files'])} files")


if __name__ == "__main__":
    main()

"""The compiled FlashInfer modules' entry points as torch references on the CPU:
``ReferencePrefillModule`` and ``ReferenceDecodeModule`` (plan, run, and what the
wrappers read off them), built on the semantics, plan records and contract checks
of flashinfer_reference.py (read its docstring first). The harness
(flashinfer_cpu_harness.py) installs them in place of the compiled modules.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.flashinfer_reference import (
    _DECODE_TAG,
    _PREFILL_TAG,
    DECODE_GROUP_SIZES,
    MASK_CAUSAL,
    MASK_NON_CAUSAL,
    KernelContractError,
    PlanRecord,
    Specialization,
    _cache_geometry,
    _check_against_plan,
    _paged_attention,
    _read_plan,
    _require,
    _write_plan,
)


class ReferencePrefillModule:
    """Stands in for the built FA2 batch-prefill module (``plan``, ``paged_run``);
    FlashInfer's prefill wrapper and its tensor-core decode path both use it."""

    def __init__(self, backend: str, *jit_args: Any) -> None:
        _require(backend == "fa2", f"only the fa2 prefill backend is modelled, not {backend}")
        # jit_args: dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_qk, head_dim_vo,
        # pos_encoding_mode, use_sliding_window, use_logits_soft_cap, use_fp16_qk_reduction
        self.spec = Specialization(*jit_args[:9])
        self.spec.check_supported()

    def plan(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        page_locked_int_workspace_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,  # host, (batch + 1)
        kv_indptr: torch.Tensor,  # host, (batch + 1), in pages
        kv_len_arr: torch.Tensor,  # host; the C++ planner ignores it
        total_num_rows: int,
        batch_size: int,
        num_qo_heads: int,
        num_kv_heads: int,
        page_size: int,
        enable_cuda_graph: bool,
        head_dim_qk: int,
        head_dim_vo: int,
        causal: bool,
        window_left: int,
        fixed_split_size: int,
        disable_split_kv: bool,
        num_colocated_ctas: int = 0,
        uniform_q_len: int = 0,
    ) -> list[int]:
        reference.CALLS["prefill.plan"] += 1
        reference.PLACEMENT.require_host("qo_indptr (prefill plan)", qo_indptr)
        reference.PLACEMENT.require_host("kv_indptr (prefill plan)", kv_indptr)
        self.spec.check_index(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        _require(num_qo_heads % num_kv_heads == 0, "num_qo_heads % num_kv_heads != 0")
        _require(qo_indptr.numel() == kv_indptr.numel() == batch_size + 1, "indptr sizes")
        _require((head_dim_qk, head_dim_vo) == (self.spec.head_dim_qk,) * 2, "head_dim")
        qo = qo_indptr.tolist()
        _require(all(a <= b for a, b in itertools.pairwise(qo)), "qo_indptr decreases")
        _require(qo[-1] <= total_num_rows, "qo_indptr exceeds total_num_rows")
        record = PlanRecord(
            _PREFILL_TAG,
            batch_size,
            num_qo_heads,
            num_kv_heads,
            page_size,
            head_dim_qk,
            qo,
            kv_indptr.tolist(),
        )
        return _write_plan(
            int_workspace_buffer, page_locked_int_workspace_buffer, record, enable_cuda_graph
        )

    def paged_run(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        plan_info_vec: list[int],
        q: torch.Tensor,  # (rows, qo_heads, head_dim)
        paged_k_cache: torch.Tensor,
        paged_v_cache: torch.Tensor,
        qo_indptr: torch.Tensor,  # device, (batch + 1)
        paged_kv_indptr: torch.Tensor,  # device, (batch + 1)
        paged_kv_indices: torch.Tensor,  # device, page ids
        paged_kv_last_page_len: torch.Tensor,  # device, (batch,)
        o: torch.Tensor,
        maybe_lse: torch.Tensor | None,
        mask_mode: int,
        layout: int,
        window_left: int,
        enable_pdl: bool,
        maybe_custom_mask: torch.Tensor | None,
        maybe_mask_indptr: torch.Tensor | None,
        maybe_alibi_slopes: torch.Tensor | None,
        maybe_prefix_len_ptr: torch.Tensor | None,
        maybe_token_pos_in_items_ptr: torch.Tensor | None,
        maybe_max_item_len_ptr: torch.Tensor | None,
        maybe_k_cache_sf: torch.Tensor | None,
        maybe_v_cache_sf: torch.Tensor | None,
        logits_soft_cap: float,
        sm_scale: float,
        rope_rcp_scale: float,
        rope_rcp_theta: float,
        token_pos_in_items_len: int,
    ) -> None:
        reference.CALLS["prefill.paged_run"] += 1
        reference.TAPE.launch(
            self._paged_run_now,
            int_workspace_buffer,
            plan_info_vec,
            q,
            paged_k_cache,
            paged_v_cache,
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            o,
            (maybe_lse, maybe_custom_mask, maybe_prefix_len_ptr, maybe_k_cache_sf),
            mask_mode,
            layout,
            window_left,
            sm_scale,
            logits_soft_cap,
        )

    def _paged_run_now(
        self,
        int_workspace: torch.Tensor,
        plan_info: list[int],
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        o: torch.Tensor,
        unmodelled: tuple[Any, ...],
        mask_mode: int,
        layout: int,
        window_left: int,
        sm_scale: float,
        logits_soft_cap: float,
    ) -> None:
        _require(all(x is None for x in unmodelled), "lse/custom mask/prefix/fp4 not modelled")
        _require(mask_mode in (MASK_NON_CAUSAL, MASK_CAUSAL), f"mask_mode {mask_mode} unmodelled")
        record = _read_plan(int_workspace, plan_info, _PREFILL_TAG)
        self.spec.check_data(q, k_cache, v_cache, o)
        self.spec.check_index(
            qo_indptr=qo_indptr,
            paged_kv_indptr=kv_indptr,
            paged_kv_indices=kv_indices,
            paged_kv_last_page_len=last_page_len,
        )
        heads, page_size = _cache_geometry(k_cache, layout)
        _check_against_plan(record, qo_indptr, kv_indptr, q.shape[1], heads, page_size)
        _require(last_page_len.numel() == record.batch_size, "last_page_len size != batch")
        window = window_left if self.spec.use_sliding_window else -1
        _paged_attention(
            q,
            k_cache,
            v_cache,
            layout,
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            o,
            mask_mode == MASK_CAUSAL,
            window,
            sm_scale,
            self.spec.soft_cap(logits_soft_cap),
        )

    def ragged_run(self, *args: Any) -> None:
        raise KernelContractError("ragged (non-paged) prefill is not modelled")


class ReferenceDecodeModule:
    """Stands in for the built CUDA-core batch-decode module (``plan``, ``run``)."""

    def __init__(self, *jit_args: Any) -> None:
        # jit_args: dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_qk, head_dim_vo,
        # pos_encoding_mode, use_sliding_window, use_logits_soft_cap
        self.spec = Specialization(*jit_args)
        self.spec.check_supported()

    def plan(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        page_locked_int_workspace_buffer: torch.Tensor,
        indptr: torch.Tensor,  # host, (batch + 1), in pages
        batch_size: int,
        num_qo_heads: int,
        num_kv_heads: int,
        page_size: int,
        enable_cuda_graph: bool,
        window_left: int,
        logits_soft_cap: float,
        head_dim_qk: int,
        head_dim_vo: int,
        empty_q_data: torch.Tensor,
        empty_kv_data: torch.Tensor,
    ) -> list[int]:
        reference.CALLS["decode.plan"] += 1
        reference.PLACEMENT.require_host("indptr (decode plan)", indptr)
        _require(
            indptr.dtype == torch.int32, "decode plan: indptr must be int32 (CHECK_INPUT_TYPE)"
        )
        _require(num_qo_heads % num_kv_heads == 0, "num_qo_heads % num_kv_heads != 0")
        group = num_qo_heads // num_kv_heads
        _require(group in DECODE_GROUP_SIZES, f"no CUDA-core decode kernel for GQA group {group}")
        _require(indptr.numel() == batch_size + 1, "indptr size != batch + 1")
        _require(head_dim_qk == head_dim_vo == self.spec.head_dim_qk, "head_dim")
        _require(
            (empty_q_data.dtype, empty_kv_data.dtype) == (self.spec.dtype_q, self.spec.dtype_kv),
            "plan's data types differ from the module's",
        )
        record = PlanRecord(
            _DECODE_TAG,
            batch_size,
            num_qo_heads,
            num_kv_heads,
            page_size,
            head_dim_qk,
            list(range(batch_size + 1)),
            indptr.tolist(),
        )
        return _write_plan(
            int_workspace_buffer, page_locked_int_workspace_buffer, record, enable_cuda_graph
        )

    def run(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        plan_info_vec: list[int],
        q: torch.Tensor,  # (batch, qo_heads, head_dim)
        paged_k_cache: torch.Tensor,
        paged_v_cache: torch.Tensor,
        paged_kv_indptr: torch.Tensor,  # device, (batch + 1)
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        o: torch.Tensor,
        maybe_lse: torch.Tensor | None,
        kv_layout_code: int,
        window_left: int,
        enable_pdl: bool,
        maybe_alibi_slopes: torch.Tensor | None,
        logits_soft_cap: float,
        sm_scale: float,
        rope_rcp_scale: float,
        rope_rcp_theta: float,
    ) -> None:
        reference.CALLS["decode.run"] += 1
        reference.TAPE.launch(
            self._run_now,
            int_workspace_buffer,
            plan_info_vec,
            q,
            paged_k_cache,
            paged_v_cache,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            o,
            maybe_lse,
            kv_layout_code,
            window_left,
            sm_scale,
            logits_soft_cap,
        )

    def _run_now(
        self,
        int_workspace: torch.Tensor,
        plan_info: list[int],
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor | None,
        layout: int,
        window_left: int,
        sm_scale: float,
        logits_soft_cap: float,
    ) -> None:
        _require(lse is None, "lse is not modelled")
        record = _read_plan(int_workspace, plan_info, _DECODE_TAG)
        self.spec.check_data(q, k_cache, v_cache, o)
        # CHECK_INPUT_TYPE(..., dl_int32) on all three in BatchDecodeWithPagedKVCacheRun.
        self.spec.check_index(
            paged_kv_indptr=kv_indptr,
            paged_kv_indices=kv_indices,
            paged_kv_last_page_len=last_page_len,
        )
        _require(kv_indptr.dtype == torch.int32, "decode run: indices must be int32")
        heads, page_size = _cache_geometry(k_cache, layout)
        # The decode kernel's batch is q.size(0): one query row per request.
        rows = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        _check_against_plan(record, rows, kv_indptr, q.shape[1], heads, page_size)
        _require(last_page_len.numel() == record.batch_size, "last_page_len size != batch")
        window = window_left if self.spec.use_sliding_window else -1
        _paged_attention(
            q,
            k_cache,
            v_cache,
            layout,
            rows,
            kv_indptr,
            kv_indices,
            last_page_len,
            o,
            False,
            window,
            sm_scale,
            self.spec.soft_cap(logits_soft_cap),
        )

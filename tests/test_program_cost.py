"""FLOPs, HBM bytes and roofline time read from optimized HLO text, loops counted (what
`tools/bench_tpu.py` puts beside MaxText's program), and the tool's own table and arguments."""

import pytest

from tests import helpers as h
from torch_on_tpu.core import hlo_text
from torch_on_tpu.training import program_cost

HLO = "\n".join([
  "%cond (p: (s32[], f32[8,16])) -> pred[] {",
  "  %c = s32[]{:T(128)} constant(4)",
  "  %i = s32[]{:T(128)} get-tuple-element(%p), index=0",
  "  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT",
  "}",
  "%fused_dot (a: bf16[8,32], b: bf16[32,16]) -> f32[8,16] {",
  "  %a = bf16[8,32]{1,0} parameter(0)",
  "  %b = bf16[32,16]{1,0} parameter(1)",
  "  ROOT %d = f32[8,16]{1,0} convolution(%a, %b), dim_labels=bf_io->bf",
  "}",
  "%fused_slice (x: bf16[1024,64], i: s32[]) -> f32[8] {",
  "  %x = bf16[1024,64]{1,0} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  %s = bf16[8,64]{1,0} dynamic-slice(%x, %i, %i), dynamic_slice_sizes={8,64}",
  "  ROOT %r = f32[8]{0} reduce(%s), dimensions={1}",
  "}",
  "%fused_update (buf: bf16[1024,64], u: bf16[8,64], i: s32[]) -> bf16[1024,64] {",
  "  %buf = bf16[1024,64]{1,0} parameter(0)",
  "  %u = bf16[8,64]{1,0} parameter(1)",
  "  %i = s32[] parameter(2)",
  "  ROOT %w = bf16[1024,64]{1,0} dynamic-update-slice(%buf, %u, %i, %i)",
  "}",
  "%batched (a: bf16[4,8,32], b: bf16[4,32,16]) -> f32[4,8,16] {",
  "  %a = bf16[4,8,32]{2,1,0} parameter(0)",
  "  %b = bf16[4,32,16]{2,1,0} parameter(1)",
  "  ROOT %c = f32[4,8,16]{2,1,0} convolution(%a, %b), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=0bf_0io->0bf",
  "}",
  "%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {",
  "  %x = bf16[8,32]{1,0} parameter(0)",
  "  %w = bf16[32,16]{1,0} parameter(1)",
  "  ROOT %f = f32[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot",
  "}",
  "ENTRY %main (l: bf16[1024,64], i: s32[], u: bf16[8,64], q: bf16[4,8,32], k: bf16[4,32,16]) -> f32[8] {",
  "  %l = bf16[1024,64]{1,0} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  %u = bf16[8,64]{1,0} parameter(2)",
  "  %q = bf16[4,8,32]{2,1,0} parameter(3)",
  "  %k = bf16[4,32,16]{2,1,0} parameter(4)",
  "  %loop = (s32[], f32[8,16]) while(%t), condition=%cond, body=%body",
  "  %bmm = f32[4,8,16]{2,1,0} fusion(%q, %k), kind=kOutput, calls=%batched",
  "  %upd = bf16[1024,64]{1,0} fusion(%l, %u, %i), kind=kLoop, calls=%fused_update",
  "  ROOT %red = f32[8]{0} fusion(%upd, %i), kind=kLoop, calls=%fused_slice",
  "}",
])


def test_flops_count_matmuls_by_loop_trips_and_batched_dots_once():
  cost = program_cost.program_cost(HLO)
  loop = 4 * 2 * 8 * 16 * 32  # the loop's dot, run 4 times
  batched = 2 * (4 * 8 * 16) * 32  # a dot batched over a window dim reads one tap of it per output
  assert cost.flops == loop + batched


def test_bytes_count_slices_and_in_place_updates_not_whole_buffers():
  by_kernel = {(f, b) for f, b, _ in program_cost.program_cost(HLO).kernels}
  update = 8 * 64 * 2
  assert (0.0, update + update + 4) in by_kernel  # reads its update and writes it in place (and reads its index)
  assert (0.0, 8 * 4 + 8 * 64 * 2 + 4) in by_kernel  # the reduction reads its slice and writes 8 floats


def test_roofline_takes_the_slower_of_compute_and_memory_per_kernel():
  cost = program_cost.ProgramCost(flops=0, hbm_bytes=0, kernels=[(100.0, 10.0, 2), (1.0, 50.0, 1)])
  assert cost.roofline_seconds(peak_flops=10.0, hbm_bandwidth=10.0, extra_flops=30.0) == 2 * 10.0 + 5.0 + 3.0


def test_a_computation_runs_as_often_as_the_loops_around_it_say():
  module = hlo_text.parse(HLO)
  runs = module.runs()
  assert runs["body"] == 4 and runs["fused_dot"] == 4 and runs["main"] == 1
  assert module.fused() == {"fused_dot", "fused_slice", "fused_update", "batched"}


# The TPU compiler's windowed einsum (a collective matmul) as it writes its loop: an unsigned
# counter from a copy of 0, stepped by 2 (two ring directions an iteration), below 4; no
# known_trip_count. And a loop whose condition reads `bound > counter`, from 1 up to 6 inclusive.
WINDOWED_HLO = "\n".join([
  "%windowed_cond (p: (u32[], f32[8,16])) -> pred[] {",
  "  %bound = u32[]{:T(128)} constant(4)",
  "  %p = (u32[], f32[8,16]) parameter(0)",
  "  %i = u32[]{:T(128)} get-tuple-element(%p), index=0",
  "  ROOT %lt = pred[]{:T(512)} compare(%i, %bound), direction=LT",
  "}",
  "%windowed_body (p: (u32[], f32[8,16])) -> (u32[], f32[8,16]) {",
  "  %p = (u32[], f32[8,16]) parameter(0)",
  "  %i = u32[]{:T(128)} get-tuple-element(%p), index=0",
  "  %two = u32[]{:T(128)} constant(2)",
  "  %next = u32[]{:T(128)} add(%i, %two)",
  "  %x = bf16[8,32]{1,0} parameter(1)",
  "  %w = bf16[32,16]{1,0} parameter(2)",
  "  %d = f32[8,16]{1,0} convolution(%x, %w), dim_labels=bf_io->bf",
  "  ROOT %t = (u32[], f32[8,16]) tuple(%next, %d)",
  "}",
  "%counting_cond (p: (s32[], f32[8,16])) -> pred[] {",
  "  %bound = s32[] constant(6)",
  "  %p = (s32[], f32[8,16]) parameter(0)",
  "  %i = s32[] get-tuple-element(%p), index=0",
  "  ROOT %gt = pred[] compare(%bound, %i), direction=GE",
  "}",
  "%counting_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {",
  "  %p = (s32[], f32[8,16]) parameter(0)",
  "  %i = s32[] get-tuple-element(%p), index=0",
  "  %one = s32[] constant(1)",
  "  %next = s32[] add(%one, %i)",
  "  %y = f32[8,16]{1,0} get-tuple-element(%p), index=1",
  "  ROOT %t = (s32[], f32[8,16]) tuple(%next, %y)",
  "}",
  "ENTRY %main (y: f32[8,16]) -> f32[8,16] {",
  "  %y = f32[8,16]{1,0} parameter(0)",
  "  %zero = u32[]{:T(128)} constant(0)",
  "  %start = u32[]{:T(128)} copy(%zero)",
  "  %init = (u32[], f32[8,16]) tuple(%start, %y)",
  "  %ring = (u32[], f32[8,16]) while(%init), condition=%windowed_cond, body=%windowed_body",
  "  %first = s32[] constant(1)",
  "  %init2 = (s32[], f32[8,16]) tuple(%first, %y)",
  "  %count = (s32[], f32[8,16]) while(%init2), condition=%counting_cond, body=%counting_body",
  "  ROOT %out = f32[8,16]{1,0} get-tuple-element(%count), index=1",
  "}",
])


def test_a_loop_runs_as_its_counter_says_from_its_start_by_its_step():
  """The TPU compiler's collective-matmul loops count by 2 without a known trip count: read as
  their bound (4), they charged twice their matmuls and permutes; read as a signed constant's
  absence (the counter is u32), once per layer, a half of them (Llama 3.1 8B on v6e-8 by the
  old reading: 390 of 540 TFLOP)."""
  runs = hlo_text.parse(WINDOWED_HLO).runs()
  assert runs["windowed_body"] == 2 and runs["windowed_cond"] == 3
  assert runs["counting_body"] == 6  # 1, 2, …, 6: `6 >= i`
  assert program_cost.program_cost(WINDOWED_HLO).flops == 2 * 2 * 8 * 16 * 32


def test_bench_tpu_tables_both_programs_and_refuses_what_it_does_not_know(capsys):
  bench = h.load_module("tools/bench_tpu.py")
  cell = dict(arguments=2**30, temporaries=2**31, host=0, collectives={"all-gather": 2**30}, bounds={}, expert_gathers=0,
              flops=1e12, expert_flops=0, hbm_bytes=1e9, roofline_s=0.4, hbm_budget=int(31.25 * 2**30), fsdp_ideal=2**31)
  moe = {**cell, "collectives": {"all-gather": 2**30, "ragged-all-to-all": 2**31}, "bounds": {"ragged-all-to-all": 2**32},
         "expert_gathers": 2**29, "flops": 3e12, "expert_flops": 2e12}
  text = bench.table({("8b-v6e", "full"): {"torch_on_tpu": cell, "MaxText": {**cell, "roofline_s": 0.5}},
                      ("qwen3-30b-v5p-ep8", "full"): {"torch_on_tpu": moe}})
  assert ("| 8b-v6e | full | torch_on_tpu | 1.00 + 2.00 = 3.00 (31.25) | 0.0 | 1.0 (1.0 / 0.0 / 0.0 / 0.0 / 0.0 / 0.0) | 0.0 "
          "| 0.50 | 1.0 | 1 | 0 | 0.400 | 0.80 × |") in text
  assert "| 3.0 (1.0 / 0.0 / 0.0 / 0.0 / 0.0 / 2.0 (≤ 4.0)) | 0.5 | 1.50 | 3.0 (2.0) |" in text
  for bad in (["--rows=70b"], ["--remats=some"], ["--maxtext=/src"]):
    with pytest.raises(SystemExit):
      bench.parse_args(bad)
  assert "--maxtext and --maxtext_python go together" in capsys.readouterr().err
  assert "deepseek-671b-v5p" not in bench.parse_args([]).rows  # opt-in: MaxText's side takes ~35 min


def test_bench_tpus_rows_read_their_model_and_count_experts_at_balanced_routing():
  """Llama 3.1 8B's 8,030,261,248 weights (FSDP's ideal: (2·2 + 2) bytes · N · 7/8 = 39.3 GiB on 8
  chips); Qwen3-30B-A3B at ep=8: our receive buffers hold twice the balanced rows, MaxText's the
  worst case, 8 × min(8, 16) / 8 = 8 times."""
  bench = h.load_module("tools/bench_tpu.py")
  assert bench.model_facts(bench.ROWS["8b-v6e"])["params"] == 8_030_261_248
  facts = bench.model_facts(bench.ROWS["qwen3-30b-v5p-ep8"])
  assert facts["experts"] == {"count": 128, "top_k": 8, "shape": (768, 2048)}
  assert bench.buffer_factor(facts, 8, ours=True) == 2 and bench.buffer_factor(facts, 8, ours=False) == 8
  assert bench.buffer_factor(facts, 1, ours=False) == 1


OFFLOAD_HLO = "\n".join([
  "%to_host (buf: bf16[16,8,64], u: bf16[1,8,64], i: s32[]) -> bf16[16,8,64] {",
  "  %buf = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)",
  "  %u = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} parameter(1)",
  "  %i = s32[] parameter(2)",
  "  ROOT %w = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} dynamic-update-slice(%buf, %u, %i, %i, %i)",
  "}",
  "%from_host (buf: bf16[16,8,64], i: s32[]) -> bf16[1,8,64] {",
  "  %buf = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  ROOT %s = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} dynamic-slice(%buf, %i, %i, %i), dynamic_slice_sizes={1,8,64}",
  "}",
  "ENTRY %main (buf: bf16[16,8,64], u: bf16[1,8,64], i: s32[]) -> bf16[1,8,64] {",
  "  %buf = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)",
  "  %u = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} parameter(1)",
  "  %i = s32[] parameter(2)",
  "  %start = ((bf16[16,8,64]{2,1,0:S(5)}, bf16[1,8,64]{2,1,0}, s32[]), bf16[16,8,64]{2,1,0:S(5)}, u32[]) async-start(%buf, %u, %i), calls=%to_host",
  "  %done = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} async-done(%start)",
  "  %back = ((bf16[16,8,64]{2,1,0:S(5)}, s32[]), bf16[1,8,64]{2,1,0}, u32[]) async-start(%done, %i), calls=%from_host",
  "  ROOT %got = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} async-done(%back)",
  "}",
])


def test_host_offload_counts_each_layers_slice_once_and_apart_from_hbm():
  """An offloaded activation is written to pinned host memory (`S(5)`) by an asynchronous update of
  one layer's slice and read back by an asynchronous slice: the device reads (then writes) that
  slice once, the host the same bytes; neither touches the whole [layers, ...] buffer."""
  cost = program_cost.program_cost(OFFLOAD_HLO)
  layer = 8 * 64 * 2
  assert cost.hbm_bytes == layer + layer  # the update read, the slice written
  assert cost.host_bytes == layer + layer  # the update written to host, the slice read from it


# The same offload as `compiled.as_text()` prints it (the async ops by name), and a prefetch into
# on-chip memory (VMEM, `S(1)`), which reads HBM once and writes none.
OFFLOAD_AS_TEXT = "\n".join([
  "ENTRY %main (buf: bf16[16,8,64], u: bf16[1,8,64], i: s32[]) -> bf16[1,8,64] {",
  "  %buf = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)",
  "  %u = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} parameter(1)",
  "  %i = s32[] parameter(2)",
  "  %host = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} custom-call(), custom_call_target=\"AllocateBuffer\"",
  "  %start = ((bf16[16,8,64]{2,1,0:S(5)}, bf16[1,8,64]{2,1,0}, s32[]), bf16[16,8,64]{2,1,0:S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%host, %u, %i, %i, %i)",
  "  %done = bf16[16,8,64]{2,1,0:T(8,128)(2,1)S(5)} dynamic-update-slice-done(%start)",
  "  %back = ((bf16[16,8,64]{2,1,0:S(5)}, s32[], s32[], s32[]), bf16[1,8,64]{2,1,0}, u32[]{:S(2)}) dynamic-slice-start(%done, %i, %i, %i), dynamic_slice_sizes={1,8,64}",
  "  %got = bf16[1,8,64]{2,1,0:T(8,128)(2,1)} dynamic-slice-done(%back)",
  "  %pre = (bf16[1,8,64]{2,1,0:S(1)}, bf16[1,8,64]{2,1,0}, u32[]{:S(2)}) copy-start(%got)",
  "  ROOT %near = bf16[1,8,64]{2,1,0:T(8,128)(2,1)S(1)} copy-done(%pre)",
  "}",
])


def test_async_ops_count_once_in_either_spelling_and_on_chip_memory_moves_no_hbm_bytes():
  layer = 8 * 64 * 2
  spelled = program_cost.program_cost(OFFLOAD_AS_TEXT)
  assert (spelled.hbm_bytes, spelled.host_bytes) == (layer + layer + layer, layer + layer)  # + the prefetch's read
  wrapped = program_cost.program_cost(OFFLOAD_HLO)
  assert (wrapped.hbm_bytes, wrapped.host_bytes) == (spelled.hbm_bytes - layer, spelled.host_bytes)


# How the TPU compiler prefetches a buffer into VMEM: asynchronous static slices of it, each run
# by its own computation; and a fusion that reads a buffer only through static slices.
PREFETCH_HLO = "\n".join([
  "%piece (whole: s8[1048576]) -> s8[65536] {",
  "  %whole = s8[1048576]{0:T(1024)(128)(4,1)} parameter(0)",
  "  ROOT %part = s8[65536]{0:T(1024)(128)(4,1)S(1)} slice(%whole), slice={[65536:131072]}",
  "}",
  "%halves (x: bf16[64,1024]) -> bf16[32,1024] {",
  "  %x = bf16[64,1024]{1,0} parameter(0)",
  "  %top = bf16[32,1024]{1,0} slice(%x), slice={[0:32], [0:1024]}",
  "  %bottom = bf16[32,1024]{1,0} slice(%x), slice={[32:64], [0:1024]}",
  "  ROOT %sum = bf16[32,1024]{1,0} add(%top, %bottom)",
  "}",
  "ENTRY %main (whole: s8[1048576], x: bf16[64,1024]) -> (s8[65536], bf16[32,1024]) {",
  "  %whole = s8[1048576]{0:T(1024)(128)(4,1)} parameter(0)",
  "  %x = bf16[64,1024]{1,0} parameter(1)",
  "  %start = ((s8[1048576]{0:T(1024)(128)(4,1)}), s8[65536]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) async-start(%whole), calls=%piece",
  "  %done = s8[65536]{0:T(1024)(128)(4,1)S(1)} async-done(%start)",
  "  %folded = bf16[32,1024]{1,0} fusion(%x), kind=kLoop, calls=%halves",
  "  ROOT %out = (s8[65536]{0:T(1024)(128)(4,1)S(1)}, bf16[32,1024]{1,0}) tuple(%done, %folded)",
  "}",
])


def test_a_slice_reads_only_its_slice_wherever_it_lands():
  """A slice into VMEM reads its 64 KiB of HBM (not the 1 MiB buffer) and writes none; a fusion
  that reads its operand through two halves reads it once whole."""
  cost = program_cost.program_cost(PREFETCH_HLO)
  assert cost.hbm_bytes == 65536 + (64 * 1024 * 2 + 32 * 1024 * 2)


NESTED_SLICE_HLO = "\n".join([
  "%layer_input (stack: bf16[32,64,128], i: s32[]) -> bf16[64,128] {",
  "  %stack = bf16[32,64,128]{2,1,0} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  %z = s32[] constant(0)",
  "  %s = bf16[1,64,128]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,64,128}",
  "  ROOT %b = bf16[64,128]{1,0} bitcast(%s)",
  "}",
  "%layer_input_whole (stack: bf16[32,64,128]) -> bf16[64,128] {",
  "  %stack = bf16[32,64,128]{2,1,0} parameter(0)",
  "  ROOT %r = bf16[64,128]{1,0} reduce(%stack), dimensions={0}",
  "}",
  "%grad (stack: bf16[32,64,128], i: s32[], w: bf16[128,128]) -> bf16[64,128] {",
  "  %stack = bf16[32,64,128]{2,1,0} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  %w = bf16[128,128]{1,0} parameter(2)",
  "  %x = bf16[64,128]{1,0} fusion(%stack, %i), kind=kLoop, calls=%layer_input",
  "  ROOT %d = bf16[64,128]{1,0} convolution(%x, %w), dim_labels=bf_io->bf",
  "}",
  "%grad_whole (stack: bf16[32,64,128], w: bf16[128,128]) -> bf16[64,128] {",
  "  %stack = bf16[32,64,128]{2,1,0} parameter(0)",
  "  %w = bf16[128,128]{1,0} parameter(1)",
  "  %x = bf16[64,128]{1,0} fusion(%stack), kind=kLoop, calls=%layer_input_whole",
  "  ROOT %d = bf16[64,128]{1,0} convolution(%x, %w), dim_labels=bf_io->bf",
  "}",
  "ENTRY %main (stack: bf16[32,64,128], i: s32[], w: bf16[128,128]) -> (bf16[64,128], bf16[64,128]) {",
  "  %stack = bf16[32,64,128]{2,1,0} parameter(0)",
  "  %i = s32[] parameter(1)",
  "  %w = bf16[128,128]{1,0} parameter(2)",
  "  %sliced = bf16[64,128]{1,0} fusion(%stack, %i, %w), kind=kOutput, calls=%grad",
  "  %whole = bf16[64,128]{1,0} fusion(%stack, %w), kind=kOutput, calls=%grad_whole",
  "  ROOT %out = (bf16[64,128]{1,0}, bf16[64,128]{1,0}) tuple(%sliced, %whole)",
  "}",
])


def test_a_slice_inside_a_nested_fusion_reads_only_its_slice():
  """A matmul fusion whose operand a nested loop fusion slices (one layer's input from a scan's
  stacked residuals) reads that layer's slice, not the stack; one that reduces the whole stack
  reads it whole. (Counted whole, MaxText's 8B step on v6e-8 read 867 GB instead of 468.)"""
  kernels = program_cost.program_cost(NESTED_SLICE_HLO).kernels
  layer, stack, weight, out, index = 64 * 128 * 2, 32 * 64 * 128 * 2, 128 * 128 * 2, 64 * 128 * 2, 4
  assert sorted(b for _, b, _ in kernels) == [layer + index + weight + out, stack + weight + out]


# `ragged_dot`'s weight gradient as the TPU compiler writes it (8 experts, 512 rows, 256 → 128):
# a convolution batched over the experts by a window as wide as the input's dilation, and a
# Mosaic kernel (its forward) run twice by a loop, with the cost estimate its backend_config carries.
RAGGED_HLO = "\n".join([
  "%cond (p: (s32[], f32[512,128])) -> pred[] {",
  "  %p = (s32[], f32[512,128]) parameter(0)",
  "  %c = s32[] constant(2)",
  "  %i = s32[] get-tuple-element(%p), index=0",
  "  ROOT %lt = pred[] compare(%i, %c), direction=LT",
  "}",
  "%body (p: (s32[], f32[512,128])) -> (s32[], f32[512,128]) {",
  "  %p = (s32[], f32[512,128]) parameter(0)",
  "  %i = s32[] get-tuple-element(%p), index=0",
  "  %one = s32[] constant(1)",
  "  %next = s32[] add(%i, %one)",
  "  %x = bf16[512,256]{1,0} parameter(1)",
  "  %w = bf16[8,256,128]{2,1,0} parameter(2)",
  '  %k = f32[512,128]{1,0:T(8,128)} custom-call(%x, %w), custom_call_target="tpu_custom_call", '
  'backend_config={"flag_configs":[],"custom_call_config":{"body":"...","cost_estimate":{"flops":"33554432",'
  '"transcendentals":"0","bytes_accessed":"1048608","remote_bytes_transferred":"0"},"needs_layout_passes":true}}',
  "  ROOT %t = (s32[], f32[512,128]) tuple(%next, %k)",
  "}",
  "%convolution_select_fusion (a: bf16[8,512,256], k: f32[8,512,128]) -> bf16[8,256,128] {",
  "  %a = bf16[8,512,256]{2,1,0} parameter(0)",
  "  %k = f32[8,512,128]{2,1,0} parameter(1)",
  "  ROOT %c = bf16[8,256,128]{2,1,0} convolution(%a, %k), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0fb_0io->0bf",
  "}",
  "ENTRY %main (a: bf16[8,512,256], k: f32[8,512,128], t: (s32[], f32[512,128])) -> bf16[8,256,128] {",
  "  %a = bf16[8,512,256]{2,1,0} parameter(0)",
  "  %k = f32[8,512,128]{2,1,0} parameter(1)",
  "  %t = (s32[], f32[512,128]) parameter(2)",
  "  %loop = (s32[], f32[512,128]) while(%t), condition=%cond, body=%body",
  "  ROOT %dw = bf16[8,256,128]{2,1,0} fusion(%a, %k), kind=kOutput, calls=%convolution_select_fusion",
  "}",
])


def test_a_convolution_batched_by_a_dilated_window_reads_one_position_per_output():
  """`window={size=8 stride=7 lhs_dilate=8}` over 8 experts: each output position's window holds
  one real input position (the rest are the dilation's holes): the dense masked product XLA runs,
  2·G·M·K·N, not 8× that. (So read, the real transpose compiled for Qwen3-30B-A3B's 32,768 rows ×
  2,048 → 768 over 128 experts on a v5p chip is 2·G·M·K·N to the FLOP: 13.19 TFLOP.)"""
  assert program_cost.program_cost(RAGGED_HLO).flops == 2 * 8 * 512 * 256 * 128


def test_mosaic_kernels_flops_are_their_cost_estimates_counted_apart_loops_counted():
  """A Mosaic kernel's FLOPs are what its cost estimate says, times the loop's trips, in
  `kernel_flops`; `flops` keeps the matmuls XLA writes (callers add attention's from the model)."""
  cost = program_cost.program_cost(RAGGED_HLO)
  assert cost.kernel_flops == 2 * 33554432
  assert cost.flops == 2 * 8 * 512 * 256 * 128  # the kernel's not in it

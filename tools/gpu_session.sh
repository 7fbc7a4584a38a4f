#!/usr/bin/env bash
# One GPU call that runs named sections, each under its own time limit, so that a device call
# (10 minutes at most) does everything it can and one hung section cannot take the others with
# it. Logs and JSON land in OUT/work and come back packed as OUT/results.tgz (the device tool
# returns at most 8 files); OUT/summary.txt has one line per section and is printed last.
#
# Usage on a CUDA machine, from the repository root:
#   bash tools/gpu_session.sh OUT SECTION[:SECONDS] ...        (default 300 s a section)
# Sections: `tools/gpu_session.sh OUT list` prints each one and its command (cp_bwd_bench*,
#   cp_train*, cp_long and cp_long_proxy need two GPUs; cp_tests and cp_bwd_tests skip their
#   two-GPU tests with one). A GPU test file is a section by its path, tests/test_x_gpu.py[:SECONDS]
#   (its log OUT/work/tests_test_x_gpu.py.log), some of its tests by pytest's -k after an @:
#   "tests/test_x_gpu.py@EXPR[:SECONDS]" (EXPR without a colon; one argument, quoted).
set -u -o pipefail
out=${1:?usage: tools/gpu_session.sh OUT SECTION[:SECONDS] ...}
shift
work="$out/work"
pytest_gpu="python3 -m pytest -m gpu -q -p no:cacheprovider"
# Two processes on one host's GPUs, NVLink multicast off (the device tool's KINDS.md says why).
torchrun2="NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --nproc-per-node 2"

section_command() {
  case "$1" in
    check) echo "python3 -m attngen check examples/*.yaml" ;;
    safety) echo "bash tools/gpu_api.sh $work/api" ;;
    safety_kernels) echo "$pytest_gpu tests/test_safety_gpu.py" ;;
    bounds_cost) echo "python3 tools/bench_bounds_cost.py --baseline bounds_baseline --out $work" ;;
    verify_data) echo "python3 -m attngen verify-tiling --recompile --save-data --jobs 16" ;;
    verify_backward) echo "python3 -m attngen verify-tiling --backward --save-data --jobs 16; cp attngen/verify/data/backward_compile_triton-*.json $work/" ;;
    host_public) echo "python3 tools/host_overhead.py" ;;
    models_tests) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_model_fields_gpu.py \
      && $pytest_gpu tests/test_prefill_gpu.py tests/test_decode_gpu.py \
      -k 'gpt_oss or llama4 or deepseek'" ;;
    models_quick) echo "$pytest_gpu tests/test_model_fields_gpu.py \
      && $pytest_gpu tests/test_prefill_gpu.py tests/test_decode_gpu.py \
      -k 'gpt_oss or llama4 or deepseek or small_launches'" ;;
    plans_tests) echo "$pytest_gpu tests/test_runtime_plans.py" ;;
    # The varlen and decode call plans against the full path, per-batch ALiBi slopes.
    plans_alibi) echo "$pytest_gpu tests/test_plans_gpu.py tests/test_alibi_per_batch_gpu.py" ;;
    flash_entry_tests) echo "$pytest_gpu tests/test_plans_gpu.py -k attention_flash" ;;
    models_bench) echo "python3 tools/bench_models.py --out $work" ;;
    mla_bench) echo "python3 tools/bench_models.py --only mla --out $work" ;;
    rotary_tests) echo "$pytest_gpu tests/test_rotary_gpu.py" ;;
    mla_tests) echo "$pytest_gpu tests/test_decode_gpu.py tests/test_rotary_gpu.py -k deepseek" ;;
    # The decode kernels after fused rotary and the absorbed MLA kernel, and the prefill
    # modules' flash-layout entry points and the call plans.
    decode_rotary) echo "$pytest_gpu tests/test_rotary_gpu.py tests/test_decode_gpu.py" ;;
    plans_gpu) echo "$pytest_gpu tests/test_plans_gpu.py tests/test_alibi_per_batch_gpu.py \
      && $pytest_gpu tests/test_model_fields_gpu.py -k latent" ;;
    decode_tests) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_decode_gpu.py" ;;
    prefill_tests) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_prefill_gpu.py" ;;
    integration_tests) echo "$pytest_gpu tests/test_integration_gpu.py" ;;
    hf_static) echo "$pytest_gpu tests/test_integration_gpu.py -k cache_decode_module" ;;
    decode_property) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_decode_gpu.py -k property_cases" ;;
    train_step) echo "python3 tools/bench_train_step.py --out $work" ;;
    # A Llama-3-8B-shaped 2-layer model's loss.backward() against SDPA's, and the cache routes.
    training_tests) echo "$pytest_gpu tests/test_integration_gpu.py -k 'training or cache_decode'" ;;
    profile_dynamic) echo "python3 tools/profile_dynamic_decode.py --out $work" ;;
    profile_model) echo "python3 tools/profile_model.py --out $work" ;;
    model_prefill) echo "python3 tools/bench_model.py --out $work --prefill 1024,8192 --impls attngen,sdpa \
      --decode-modes ''" ;;
    model_decode) echo "python3 tools/bench_model.py --out $work --prefill 1024 --impls attngen,sdpa \
      --decode-modes dynamic,static,graph" ;;
    # Eager modes with the implementations taking turns in every repeat (host drift hits both).
    model_eager) echo "python3 tools/bench_model.py --out $work/model_eager --impls attngen,sdpa \
      --decode-modes dynamic,static" ;;
    # Every context-parallel GPU test: one GPU's, and with two GPUs the NCCL pairs (forward at
    # 128k, gradients at 4096 and 128k, the backward's head groups: bitwise and memory).
    cp_tests) echo "NCCL_NVLS_ENABLE=0 $pytest_gpu -rs tests/test_context_parallel_gpu.py" ;;
    # One entry point's host time split into its Python and its launches, each launch timed
    # through Triton's launcher with tensors, with addresses, and through the C launcher.
    profile_launch) echo "python3 tools/profile_launch_host.py --out $work" ;;
    bench_decode) echo "python3 tools/bench_decode.py --out $work" ;;
    # The causal N 16k backward: each kernel's time in a flash_attn_func step (a process of
    # its own), then the grid's cells with the module's backward alone beside cuDNN's.
    bwd_causal_gap) echo "python3 tools/profile_step.py --out $work --cells 128:16384:1 \
      64:16384:1 128:16384:0 && python3 tools/bench_grid.py --out $work/g16 --d 64,128 \
      --n 16384 --causal 1 --impls attngen,cudnn" ;;
    profile_decode) echo "python3 tools/profile_decode_graph.py --out $work" ;;
    public_prefill) echo "python3 tools/bench_public_prefill.py --out $work" ;;
    bench_prefill) echo "python3 tools/bench_prefill.py --out $work" ;;
    bench_model) echo "python3 tools/bench_model.py --out $work" ;;
    cp_bench) echo "python3 tools/bench_context_parallel.py --out $work" ;;
    # The forward table's 262144-token row on two GPUs, the ring now in two head groups.
    cp_fwd_256k) echo "$torchrun2 tools/bench_context_parallel.py --seqlens 262144 --out $work" ;;
    backward_tests) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_backward_gpu.py" ;;
    # The open models' gradients (sinks, chunked, sink tokens) at real sizes.
    backward_models) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu tests/test_backward_gpu.py \
      -k 'model_field or sinks_backward or varlen_model_fields'" ;;
    backward_committed) echo "$pytest_gpu tests/test_backward_gpu.py -k committed" ;;
    # The split dK/dV launches (D 256 on sm90), the fp32 cases, the tests after the real sizes.
    # backward_tests in two halves that each fit one device call.
    backward_real) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu -rf --tb=short tests/test_backward_gpu.py \
      -k 'test_gradients_at_real_sizes'" ;;
    backward_others) echo "ATTNGEN_HYPOTHESIS_PROFILE=gpu $pytest_gpu -rf --tb=short tests/test_backward_gpu.py \
      -k 'not test_gradients_at_real_sizes'" ;;
    backward_empty) echo "$pytest_gpu -rf --tb=short tests/test_backward_gpu.py -k empty_sequence" ;;
    # The decode module's full path and call plans against each other, and the runtime's plans.
    decode_plans) echo "$pytest_gpu -rf --tb=short tests/test_decode_gpu.py tests/test_runtime_plans.py" ;;
    backward_fp32) echo "$pytest_gpu -x --tb=short tests/test_backward_gpu.py -k 'real_sizes and fp32-d80 and 1000'" ;;
    backward_rest) echo "$pytest_gpu -rf --tb=short tests/test_backward_gpu.py -k 'committed and not llama3 or empty_sequence or model_field and fp32 or runtime_dropout or sinks_backward_is'" ;;
    backward_split) echo "$pytest_gpu -rf --tb=short tests/test_backward_gpu.py -k 'd256 or fp32 or committed or deterministic or dropout or empty_sequence'" ;;
    # Each kernel's device time in one forward + backward, attngen and Flex, at a few grid cells.
    profile_backward) echo "python3 tools/profile_backward_cells.py --out $work" ;;
    bench_backward) echo "python3 tools/bench_backward.py --out $work" ;;
    # The atomic-dQ backward (deterministic=False): its GPU tests, and both paths against cuDNN.
    backward_atomic) echo "$pytest_gpu -rf --tb=short tests/test_backward_atomic_gpu.py" ;;
    bench_atomic) echo "python3 tools/bench_backward.py --atomic --out $work" ;;
    # Tunes llama3_8b's dQ and dK/dV kernels (150 s of measurements, then at most one
    # candidate's overrun and the builds: give it 260 s, so that `autotune_backward:260
    # bench_backward:280` fits one call), rebuilds generated/ from tuning/sm90.json and lists
    # the modules whose bytes changed; the tree keeps them, so later sections (backward_tests)
    # run the tuned modules. Exit status: the autotune's, else 1 if the build or check failed.
    autotune_backward) echo "python3 -m attngen autotune examples/llama3_8b.yaml --arch sm90 \
      --kernels backward --budget 150; rc=\$?; \
      sha256sum generated/*/*.py generated/index.json > $work/generated_before.sha256; \
      python3 -m attngen build examples/*.yaml && python3 -m attngen check examples/*.yaml \
      || rc=1; sha256sum -c --quiet $work/generated_before.sha256 2>/dev/null \
      | sed 's/: FAILED\$//' > $work/changed_generated.txt; \
      cp tuning/sm90.json tuning/.progress-sm90.json $work/; \
      echo changed: \$(cat $work/changed_generated.txt); exit \$rc" ;;
    autotune_backward_grid) echo "python3 -m attngen autotune tools/bench_specs/backward_grid.yaml \
      --arch sm90 --kernels backward --budget ${GRID_BUDGET:-420}; rc=\$?; \
      cp tuning/sm90.json tuning/.progress-sm90.json $work/; exit \$rc" ;;
    # The grid's D 256 specs alone (the same fields, so the same tuning keys): the split dV and
    # dK launches, the fused launch and dQ, each timed alone.
    autotune_split) echo "python3 -c \"import yaml; g = yaml.safe_load(open('tools/bench_specs/backward_grid.yaml')); \
      g['variants'] = {k: v for k, v in g['variants'].items() if k.startswith('d256')}; \
      yaml.safe_dump(g, open('/tmp/backward_grid_d256.yaml', 'w'))\" && \
      python3 -m attngen autotune /tmp/backward_grid_d256.yaml --arch sm90 --kernels backward \
      --budget ${GRID_BUDGET:-420}; rc=\$?; cp tuning/sm90.json tuning/.progress-sm90.json $work/; exit \$rc" ;;
    # The Gluon forward's knobs: the CLI on examples/qwen2_5_7b.yaml into $work/tuning (the
    # repository's tuning/ untouched), whose prefill entry must gain the "gluon" field with
    # times (copied back); then the test that builds from such a file and runs the winner.
    autotune_gluon) echo "python3 -m attngen autotune examples/qwen2_5_7b.yaml --arch sm90 \
      --kernels forward --max-configs 2 --budget 150 --tuning $work/tuning; rc=\$?; \
      python3 -c \"import json, sys; e = json.load(open('$work/tuning/sm90.json'))['entries']; \
      g = [v['gluon'] for v in e.values() if 'gluon' in v]; print('gluon fields:', g); \
      sys.exit(0 if g and g[0]['median_ms'] else 1)\" || rc=1; exit \$rc" ;;
    autotune_gluon_test) echo "$pytest_gpu -rf --tb=short tests/test_tuning_gluon_gpu.py" ;;
    ondemand_tests) echo "$pytest_gpu tests/test_ondemand_gpu.py" ;;
    cold_start) echo "python3 tools/ondemand_cold_start.py --json $work/cold_start.json" ;;
    cp_bwd_tests) echo "NCCL_NVLS_ENABLE=0 $pytest_gpu tests/test_context_parallel_gpu.py -k gradients" ;;
    cp_bwd_steps) echo "python3 tools/bench_context_parallel_backward.py --out $work" ;;
    # Forward + backward on two GPUs against one and PyTorch's CP (cuDNN, FA2), 32k-256k, MHA
    # 32/32 and GQA 32/8: about 8 minutes (give it a call of its own); the _mha and _gqa
    # halves fit 300 s each. The JSON is rewritten after every row.
    cp_bwd_bench) echo "$torchrun2 tools/bench_context_parallel_backward.py --budget 1 --out $work" ;;
    cp_bwd_bench_mha) echo "$torchrun2 tools/bench_context_parallel_backward.py --budget 1 --heads 32/32 --out $work" ;;
    cp_bwd_bench_gqa) echo "$torchrun2 tools/bench_context_parallel_backward.py --budget 1 --heads 32/8 --out $work" ;;
    # A training step (forward + backward) past one H200 on two: OPT-175B heads, N = 819,200,
    # about 17 s of forward and 90 s of backward, 3-4 minutes in all (give it 420 s);
    # cp_train_proxy caps each process at a quarter of its GPU (N = 204,800, about 1 minute).
    cp_train) echo "$torchrun2 tools/cp_train_step.py --out $work" ;;
    cp_train_proxy) echo "$torchrun2 tools/cp_train_step.py --memory-fraction 0.25 --out $work" ;;
    # A causal forward whose q, k, v and out exceed one H200 (OPT-175B heads, N = 1.64M), on
    # two: about 80 s of forward, 2-3 minutes in all (give it 420 s); cp_long_proxy caps each
    # process at a quarter of its GPU and sizes N against that (N = 410k, about 1 minute).
    cp_long) echo "$torchrun2 tools/cp_long_sequence.py --out $work" ;;
    cp_long_proxy) echo "$torchrun2 tools/cp_long_sequence.py --memory-fraction 0.25 --out $work" ;;
    # What landed without a GPU run (the runtime's restructure and route cache, the header
    # check, the flash-layout entry points everywhere): the runtime's GPU tests.
    runtime_tests) echo "$pytest_gpu -rf --tb=short tests/test_plans_gpu.py tests/test_api_gpu.py \
      tests/test_ondemand_gpu.py tests/test_rotary_gpu.py tests/test_integration_gpu.py" ;;
    # Programmable attention: the expression kernels (forward, backward, decode), block
    # sparsity, flex_attention against compiled Flex; then the block-sparse benchmark.
    expr_tests) echo "$pytest_gpu -rf --tb=short tests/test_expression_kernels_gpu.py \
      tests/test_block_sparse_gpu.py tests/test_flex_api.py tests/test_flex_blocks.py \
      tests/test_flex_grad.py tests/test_expression_decode_gpu.py tests/test_block_sparse_backward_gpu.py" ;;
    variants_softcap) echo "$pytest_gpu -rf --tb=short tests/test_gluon_variants_gpu.py -k 'softcap or gemma2'" ;;
    bench_flex) echo "python3 tools/bench_flex.py --out $work" ;;
    # score_mod / mask_mod in the Gluon kernels (behind ATTNGEN_GLUON_VARIANTS=1): the forward's
    # GPU tests, then the Flex table with them (attngen_expr against the built-in kernels).
    gluon_expr) echo "ATTNGEN_GLUON_VARIANTS=1 $pytest_gpu -rf --tb=short tests/test_gluon_expressions_gpu.py \
      -k 'not gradients' && ATTNGEN_GLUON_VARIANTS=1 python3 tools/bench_flex.py --out $work/gluon_expr" ;;
    gluon_expr_fwd) echo "ATTNGEN_GLUON_VARIANTS=1 $pytest_gpu -rf --tb=short tests/test_gluon_expressions_gpu.py \
      -k 'not gradients'" ;;
    # The gym's expression mods (the expression kernels, Gluon with the switch) against Flex.
    flex_expr) echo "ATTNGEN_GLUON_VARIANTS=1 python3 tools/bench_flex.py --out $work/flex \
      --mods document 'relative bias' prefix-LM" ;;
    gluon_expr_bwd) echo "ATTNGEN_GLUON_VARIANTS=1 $pytest_gpu -rf --tb=short tests/test_gluon_expressions_gpu.py \
      -k gradients" ;;
    # The expression file whole in four processes at once (its time is mostly compiling):
    # forward and backward, D 64 and D 128, one log each, then every log's last line.
    gluon_expr_par) echo "for k in 'gradients and 64' 'gradients and not 64' 'not gradients and 64' \
      'not gradients and not 64'; do ATTNGEN_GLUON_VARIANTS=1 $pytest_gpu -rf --tb=short \
      tests/test_gluon_expressions_gpu.py -k \"\$k\" > \"$work/expr_\${k// /_}.log\" 2>&1 & done; \
      wait; tail -qn1 $work/expr_*.log; ! grep -q 'failed\\|error' $work/expr_*.log" ;;
    # Out-of-bounds accesses of the served D 256 backward and the hostile index lists.
    memcheck) echo "compute-sanitizer --tool memcheck --error-exitcode 9 $pytest_gpu \
      tests/test_gluon_backward_gpu.py -k d256 && ATTNGEN_GLUON_VARIANTS=1 compute-sanitizer \
      --tool memcheck --error-exitcode 9 $pytest_gpu tests/test_gluon_expressions_gpu.py \
      tests/test_block_sparse_gpu.py -k hostile" ;;
    # Candidate kernel changes against the kernels (tools/ab_alt/: patches of the templates).
    ab_alt) echo "bash tools/ab_alt/run.sh $work" ;;
    # The causal dK/dV kernel alone under Nsight Compute against its heads interleaved as
    # many as fit L2 (tools/ab_alt/bwd_heads_in_l2.patch: at N 16k D 128 / 256 one, D 64 two;
    # D 128 N 4k four, the module's order: a control), then the new head-order GPU case.
    ncu_heads) echo "KERNELS=_gluon_attn_bwd DIMS='128 64 256' LENGTHS=16384 MASKS=causal \
      bash tools/ab_alt/ncu.sh $work bwd_heads_in_l2 && KERNELS=_gluon_attn_bwd DIMS=128 \
      LENGTHS=4096 MASKS=causal bash tools/ab_alt/ncu.sh $work bwd_heads_in_l2 \
      && $pytest_gpu -rf tests/test_gluon_backward_gpu.py -k any_head_order" ;;
    # The dK/dV kernel alone under Nsight Compute against dK and dV stored by TMA through the
    # dQ staging (tools/ab_alt/bwd_tma_epilogue.patch: BLOCK_M 64 forms; D 64 unmasked runs
    # BLOCK_M 128, unchanged: a control), at N 1k where a CTA's fixed cost weighs most.
    ncu_epilogue) echo "KERNELS=_gluon_attn_bwd DIMS='128 64' LENGTHS=1024 \
      MASKS='unmasked causal' bash tools/ab_alt/ncu.sh $work bwd_tma_epilogue" ;;
    # The dK/dV kernel alone under Nsight Compute against its persistent forms
    # (tools/ab_alt/bwd_persistent_dynamic*.patch: a CTA an SM takes the module's tiles in
    # order by an atomic counter, the producer loading the next tile's K, V and first blocks
    # while the consumers store dK and dV; _tma: dK, dV stored by TMA, BLOCK_M 64 forms).
    ncu_persistent) echo "KERNELS=_gluon_attn_bwd DIMS='128 64 256' LENGTHS='1024 4096 16384' \
      MASKS='unmasked causal' bash tools/ab_alt/ncu.sh $work \
      bwd_persistent_dynamic_tma,bwd_persistent_dynamic" ;;
    # The GPU backward tests on the templates with a candidate patch applied (PATCH, default
    # bwd_persistent_dynamic_tma; PATCH_K: pytest's -k; the tree's templates restored after).
    patched_bwd_tests) echo "git apply -p1 --directory=attngen/templates \
      tools/ab_alt/\${PATCH:-bwd_persistent_dynamic_tma}.patch && { $pytest_gpu -rf --tb=short \
      tests/test_gluon_backward_gpu.py \${PATCH_K:+-k \"\$PATCH_K\"}; rc=\$?; \
      git apply -R -p1 --directory=attngen/templates tools/ab_alt/\${PATCH:-bwd_persistent_dynamic_tma}.patch; \
      exit \$rc; }" ;;
    # The forward kernel alone under Nsight Compute against K_j and V_{j-1} behind one ready
    # and one empty barrier a step (tools/ab_alt/fwd_kv_one_slot.patch: a key block's consumer
    # loop one warpgroup bar.sync and two mbarrier operations fewer, cross-compiled).
    ncu_fwd_slot) echo "KERNELS=_gluon_attn_fwd DIMS='128 64' LENGTHS=16384 \
      MASKS='unmasked causal' bash tools/ab_alt/ncu.sh $work fwd_kv_one_slot" ;;
    # The D 64 causal backward's long form chosen per call (4096 keys or more): its two GPU
    # cases, then the grid's D 64 cells beside cuDNN.
    long_causal) echo "$pytest_gpu -rf --tb=short tests/test_gluon_backward_gpu.py -k 4100 \
      && python3 tools/bench_grid.py --out $work/g64 --d 64 --impls attngen,cudnn" ;;
    # The D 128 backward with dQ a step late and the long causal form: their GPU cases, the
    # D 128 grid beside cuDNN (two rounds), a training step's host time (no FA4 needed).
    dlate_tests) echo "$pytest_gpu -rf --tb=short tests/test_gluon_backward_gpu.py -k 'd128 or 4100'" ;;
    grid128) echo "python3 tools/bench_grid.py --out $work/g128 --d 128 --impls attngen,cudnn --rounds 2" ;;
    step_host_alone) echo "python3 tools/step_host.py --out $work/step --cells 128:1024:1" ;;
    # A new flex_attention mod's first call, its phases timed (the issue's 100 ms).
    flex_cold) echo "python3 tools/flex_cold_start.py --device cuda --json $work/flex_cold.json" ;;
    bench_sparse) echo "python3 tools/bench_block_sparse.py --out $work" ;;
    # The Gluon forward's variants and the modules' Gluon dK/dV backward (the varlen form built
    # with ATTNGEN_GLUON_VARIANTS=1 inside its tests): float64 checks through the public functions.
    gluon_tests) echo "$pytest_gpu -rf --tb=short tests/test_gluon_gpu.py tests/test_gluon_variants_gpu.py \
      tests/test_gluon_backward_gpu.py tests/test_gluon_varlen_gpu.py" ;;
    gluon_varlen_tests) echo "$pytest_gpu -rf --tb=short tests/test_gluon_varlen_gpu.py" ;;
    gluon_bwd_tests) echo "$pytest_gpu -rf --tb=short tests/test_gluon_backward_gpu.py" ;;
    # The D 256 form of the Gluon backward: its GPU cases, then the grid's D 256 cells (FA4
    # where it is on the path).
    d256_bwd) echo "$pytest_gpu -rf --tb=short tests/test_gluon_backward_gpu.py -k d256 \
      && python3 tools/bench_grid.py --out $work/d256 --d 256 --impls attngen,fa4,cudnn" ;;
    # The Gluon dK/dV backward through flash_attn_func against the tile-level backward, cuDNN
    # and FA4 (FA4 where importable: `source tools/gpu_fa4.sh` in the same call first).
    d256_tests) echo "$pytest_gpu -rf --tb=short tests/test_gluon_backward_gpu.py -k d256" ;;
    # The D 128 causal N 16k cell beside the deterministic backward only (no FA4 in the process).
    grid_det) echo "python3 tools/bench_grid.py --out $work/det --d 128 --n 16384 --causal 1 \
      --impls attngen,attngen_det,cudnn" ;;
    # The whole grid beside FA4 and cuDNN (FA4 ready: `source tools/gpu_fa4.sh` first).
    grid_full) echo "python3 tools/bench_grid.py --out $work/grid --impls attngen,fa4,cudnn --budget-s 330" ;;
    step_host) echo "python3 tools/step_host.py --out $work/step --cells 128:1024:1 --fa4" ;;
    # The Gluon dK/dV kernel with and without dQ (deterministic=True runs it without), causal
    # and not: what dQ's staging and reduce-adds cost where the unmasked backward trails FA4.
    profile_dq) echo "python3 tools/profile_step.py --out $work/pdq --cells 128:16384:0 128:16384:1 \
      64:16384:0 128:4096:0 --deterministic" ;;
    # Each kernel of a step at the grid's losing cells, attngen beside FA4 (`source tools/gpu_fa4.sh`).
    ncu_versus) echo "python3 tools/ncu_versus.py --out $work/ncu" ;;
    gluon_bwd_bench) echo "python3 tools/gluon_backward.py --out $work" ;;
    # The open Gluon variants against the same specs' tile-level forward (and FA4 if on the
    # path); the grid's N 1k cells with the dispatch recorded.
    variants_bench) echo "python3 tools/bench_gluon_variants.py --out $work" ;;
    # The gated Gluon varlen forward against the tile-level one (and FA4's varlen if on the path).
    varlen_bench) echo "python3 tools/bench_gluon_varlen.py --out $work" ;;
    grid_n1k) echo "python3 tools/bench_grid.py --out $work --d 128,256 --n 1024 --impls attngen,cudnn" ;;
    probe_cells) echo "python3 tools/probe_cells.py --out $work" ;;
    # Decode: fp8 caches and tree drafts, tests then benchmarks.
    decode_new) echo "$pytest_gpu -rf --tb=short tests/test_decode_gpu.py tests/test_decode_fp8_gpu.py \
      tests/test_decode_tree_gpu.py" ;;
    bench_decode_new) echo "python3 tools/bench_decode_fp8.py --out $work && \
      python3 tools/bench_decode_fp8.py --tokens 8 --out $work/tokens8 && \
      python3 tools/bench_decode_tree.py --out $work" ;;
    # Any GPU test file by its path, e.g. tests/test_decode_gpu.py:250.
    tests/*.py) echo "$pytest_gpu -rf --tb=short $1" ;;
    # Some of its tests: tests/test_x_gpu.py@EXPR[:SECONDS], EXPR pytest's -k (no colon).
    tests/*.py@*) echo "$pytest_gpu -rf --tb=short ${1%%@*} -k '${1#*@}'" ;;
    *) return 1 ;;
  esac
}

if [ "${1:-}" = list ]; then
  # every section of section_command, in its order
  for name in $(sed -n 's/^    \([a-z_0-9]*\)) echo .*/\1/p' "$0"); do
    printf '%-18s %s\n' "$name" "$(section_command "$name")"
  done
  exit 0
fi

mkdir -p "$work"
source tools/gpu_env.sh
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'from attngen.render.template_env import template_loading; print("templates:", template_loading())'
  date -u +%Y-%m-%dT%H:%M:%SZ
  git log -1 --format='commit %H' 2>/dev/null || true
} > "$work/env.txt" 2>&1
summary="$out/summary.txt"
: > "$summary"
failed=0
for item in "$@"; do
  name=${item%%:*}
  limit=${item#*:}
  [ "$limit" = "$item" ] && limit=300
  command=$(section_command "$name") || { echo "$name: unknown section" >> "$summary"; failed=1; continue; }
  start=$(date +%s)
  log="$work/$(printf '%s' "$name" | tr '/ @' '___').log"
  timeout -k 10 "$limit" bash -c "$command" > "$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && failed=1
  last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-150)
  echo "$name rc=$rc $(( $(date +%s) - start ))s | $last" >> "$summary"
done
cp "$summary" "$work/summary.txt"
tar czf "$out/results.tgz" -C "$work" .
cat "$work/env.txt" "$summary"
exit $failed

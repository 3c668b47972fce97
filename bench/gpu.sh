#!/usr/bin/env bash
# GPU benchmark of the update stage (and, best effort, the HF rollout engine) on a
# Qwen2.5-0.5B-shaped model with RANDOM weights built from a config (no hub access), bf16.
# Prepared for the `device` tool (one H200); never part of CI. Usage: bash bench/gpu.sh [ROUNDS]
# Prints trainer tokens/s and MFU vs the H200's dense bf16 peak (989 TFLOP/s, spec sheet), then the
# HF engine vs a bare model.generate on the same model, then bench/rollout.py (tiny, small) on the GPU.
# The GPU-marked tests (CUDA parity of rollout log-probs, the update and DeepSpeed) run first:
#   pytest -m gpu tests/rollout/test_tiny_model_rollout.py tests/training
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 ROUNDS=${1:-3}
"$PY" - <<'PYEOF'
import os, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.token_batch import collate
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.training.update import ppo_update

assert torch.cuda.is_available(), "no CUDA device"
PEAK = 989e12  # H200 dense bf16 FLOP/s
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1000000.0)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).cuda()
n = sum(p.numel() for p in model.parameters())
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(5): a @ a  # warm-up: clocks ramp and cuBLAS picks its kernel
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ a
torch.cuda.synchronize(); mm = 2 * 8192**3 * 20 / (time.perf_counter() - t)
print(f"params {n/1e6:.0f}M; measured bf16 mm {mm/1e12:.0f} TFLOP/s")
batch = collate(synthetic_trajectories(n_groups=16, group_size=8, vocab=150000, turns=5, prompt_len=256,
                                       resp_len=128, obs_len=96))  # 128 trajectories
batch = batch.to("cuda")
print(f"batch {batch.batch_size} x {batch.seq_len}, {batch.num_tokens} tokens")
algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
for micro in (8, 16):
    optim = OptimConfig(lr=1e-6, minibatch_size=64, micro_batch_size=micro, amp_dtype="bfloat16")
    actor = make_train_model(model, make_optimizer(model, lr=optim.lr, weight_decay=0.0), optim)
    gen = torch.Generator().manual_seed(0)
    best = None
    for r in range(int(os.environ["ROUNDS"]) + 1):
        torch.cuda.synchronize()
        m = ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=gen)
        torch.cuda.synchronize()
        if r and (best is None or m["timing/update_s"] < best["timing/update_s"]):
            best = m
    fl = 6 * n * best["perf/tokens"] / best["timing/update_s"]
    print(f"update micro={micro}: {best['timing/update_s']:.2f}s {best['perf/tokens_per_s']:.0f} tok/s "
          f"{fl/1e12:.1f} TFLOP/s (6NT) MFU {100*fl/PEAK:.1f}% of spec, {100*fl/mm:.1f}% of measured mm; "
          f"max mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
    del actor
    torch.cuda.empty_cache()

try:  # rollout: the HF engine, batched sampling of 128 responses x 128 tokens (best effort)
    from ragen_tasks.models.tokenizer import build_tokenizer
    from ragen_tasks.rollout.engine import GenerationRequest, SamplingParams
    from ragen_tasks.rollout.hf_engine import HFEngine
    model = model.to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    eng = HFEngine(model, build_tokenizer(), eos_token_ids=[])
    reqs = [GenerationRequest(session_id=str(i), prompt_ids=list(range(1, 257))) for i in range(128)]
    params = SamplingParams(max_new_tokens=128, stop_strings=(), seed=0)
    eng.generate(reqs[:8], params); eng.release([r.session_id for r in reqs[:8]])
    torch.cuda.synchronize(); t = time.perf_counter()
    out = eng.generate(reqs, params)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    toks = sum(len(g.token_ids) for g in out)
    print(f"HF engine: {toks} tokens in {dt:.1f}s = {toks/dt:.0f} tok/s (128 sequences, 256-token prompts)")
    ids = torch.tensor([r.prompt_ids for r in reqs], device="cuda")  # (128, 256): same prompts, no padding needed
    with torch.inference_mode():
        model.generate(ids[:8], max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0)  # warm-up
        torch.cuda.synchronize(); t = time.perf_counter()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                             do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)
        torch.cuda.synchronize(); gdt = time.perf_counter() - t
    gtoks = (gen.shape[1] - ids.shape[1]) * gen.shape[0]
    print(f"model.generate: {gtoks} tokens in {gdt:.1f}s = {gtoks/gdt:.0f} tok/s; engine/generate = "
          f"{(toks/dt)/(gtoks/gdt):.2f}x", flush=True)
except Exception as e:  # never fail the update numbers because of the rollout part
    print(f"HF engine benchmark failed: {type(e).__name__}: {e}")
PYEOF

echo "== bench/rollout.py on the GPU (tiny, small presets)"
"$PY" bench/rollout.py --device cuda --threads 4 --repeats 2

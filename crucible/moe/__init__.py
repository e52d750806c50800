"""Mixture-of-Experts quantization (docs/methods.md, moe; issue: MoE quantization).

- `crucible.moe.build`: a dense Llama / Qwen2 model -> a transformers Qwen2-MoE with a shared expert
  (CMoE / MoEfication: the most active neurons shared, balanced clustering of the rest into
  experts, a fitted router);
- `crucible.moe.refit`: the training-free least-squares refit of the down projections;
- `crucible.moe.recover`: the distillation recovery from the dense model;
- `crucible.moe.lm`: perplexity and token sequences for causal LMs;
- `crucible.moe.routing`: record / replay the router's top-k choices, routing consistency,
  expert load, hidden-state drift;
- `crucible.moe.mx_experts`: MXFP4 experts (fused 3-D parameters) with per-expert low-rank adapters,
  quantize_moe;
- `crucible.moe.compensate`: calibration statistics, the error SVDs, load-aware or uniform ranks, the
  adapters;
- `crucible.moe.sensitivity`: propagation-aware loads (routed share x output-gradient sensitivity);
- `crucible.moe.rank_report`: the rank budget and where each allocation puts it;
- `crucible.moe.mx_storage`: the quantized MoE's size in bytes, its safetensors file;
- `crucible.moe.qat`: limited routing replay QAT (frozen router and quantized weights, adapters train).
"""

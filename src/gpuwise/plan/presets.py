"""Model presets: the architectures of shared/reference/published.md, from their public HF configs.

``published_params`` is the figure the model card or paper gives; the planner computes its own
count from the dimensions and a test holds the two together.
"""

_LLAMA = dict(family="llama", gated=True, tied=False)

PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(_LLAMA, layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128,
                       ffn=11008, vocab=32000, max_seq=4096, published_params=6.74e9),
    "llama-2-13b": dict(_LLAMA, layers=40, hidden=5120, heads=40, kv_heads=40, head_dim=128,
                        ffn=13824, vocab=32000, max_seq=4096, published_params=13.0e9),
    "llama-2-70b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                        ffn=28672, vocab=32000, max_seq=4096, published_params=69.0e9),
    "llama-3.1-8b": dict(_LLAMA, layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                         ffn=14336, vocab=128256, max_seq=131072, published_params=8.03e9),
    "llama-3.1-70b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                          ffn=28672, vocab=128256, max_seq=131072, published_params=70.6e9),
    "llama-3.1-405b": dict(_LLAMA, layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128,
                           ffn=53248, vocab=128256, max_seq=131072, published_params=405.9e9),
    "mistral-7b": dict(_LLAMA, family="mistral", layers=32, hidden=4096, heads=32, kv_heads=8,
                       head_dim=128, ffn=14336, vocab=32000, max_seq=32768, published_params=7.24e9),
    "qwen2.5-0.5b": dict(family="qwen2", gated=True, tied=True, qkv_bias=True, layers=24, hidden=896,
                         heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151936, max_seq=32768,
                         published_params=0.49e9),
    "qwen2.5-7b": dict(family="qwen2", gated=True, tied=False, qkv_bias=True, layers=28, hidden=3584,
                       heads=28, kv_heads=4, head_dim=128, ffn=18944, vocab=152064, max_seq=131072,
                       published_params=7.62e9),
    "gemma-2-9b": dict(family="gemma2", gated=True, tied=True, norms_per_layer=4, layers=42,
                       hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn=14336, vocab=256000,
                       max_seq=8192, published_params=9.24e9),
    "tinyllama-1.1b": dict(_LLAMA, layers=22, hidden=2048, heads=32, kv_heads=4, head_dim=64,
                           ffn=5632, vocab=32000, max_seq=2048, published_params=1.10e9),
    "llama-65b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=64, head_dim=128,
                      ffn=22016, vocab=32000, max_seq=2048, published_params=65.2e9),
}

"""The blocks the model families are built from, each once: a family (llama3/, qwen3_moe/)
subclasses the Decoder shell and writes only what is its own.

- rmsnorm.py: RMSNorm;
- rope.py: rotary embeddings (frequencies, Llama 3.1's scaling, the tables, a forward's lookup,
  the two rotation layouts);
- attention.py: grouped-query attention (optional per-head q/k norms, a KV cache);
- document_attention.py: the document masks of packed sequences and the attention kernel;
- kv_cache.py: the keys and values of a generation;
- feed_forward.py: the SwiGLU feed-forward;
- decoder.py: the shell (embedding, blocks, final norm, head and its loss, RoPE tables, init);
- tensor_parallel.py: each block's tensor-parallel plan, the vocab-parallel head, and the
  counts a degree must divide;
- hf.py: the Hugging Face names and config values the families share.
"""

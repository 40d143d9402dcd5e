# ddpmon's node daemon (also `ddpmon doctor` and `ddpmon top`) without torch, for
# deploy/kubernetes/daemonset.yaml. Build from the repository root:
#
#   docker build -f deploy/docker/daemon.Dockerfile -t ddpmon-daemon:0.1.0 .
#
# It holds ddpmon and its six dependencies (prometheus-client, psutil, nvidia-ml-py, h11, PyYAML,
# bcrypt), about 9.8 MiB over the base image; torch is not among them. NVML itself (libnvidia-ml.so) is the
# node driver's, mounted at run time by the NVIDIA container runtime. See docs/install.md.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml README.md /tmp/ddpmon/
COPY ddpmon /tmp/ddpmon/ddpmon
RUN pip install /tmp/ddpmon \
 && rm -rf /tmp/ddpmon \
 && python -c "import importlib.util, sys; sys.exit('torch is installed' if importlib.util.find_spec('torch') else 0)" \
 && ddpmon daemon --help > /dev/null

EXPOSE 9490
ENTRYPOINT ["ddpmon"]
CMD ["daemon", "--state-dir=/run/ddpmon", "--port=9490"]

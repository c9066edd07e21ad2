# shellcheck shell=sh
# The appliance's training stack (TensorFlow 2.18.1 GPU + tf-keras + Horovod 0.28.1 with NCCL and Gloo)
export PATH="/opt/appliance/venv/bin:$PATH"
export TF_USE_LEGACY_KERAS=1

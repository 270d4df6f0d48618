import os

# NOTE: must run before anything imports triton: Triton reads TRITON_INTERPRET
# when a @triton.jit function is created, and without a GPU the interpreter is
# the only way its kernels run ("0 active drivers" otherwise). setdefault, so
# that `TRITON_INTERPRET=0 pytest -m gpu` can still compile for a real GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

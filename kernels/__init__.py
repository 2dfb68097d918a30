"""specinfer's device kernels, shipped inside the wheel as `specinfer.kernels`.

- `specinfer.kernels.triton`: Triton kernels for CUDA (KV store, paged varlen attention).
- `specinfer.kernels.hpu`: the Gaudi path in plain torch (flat block-list paged attention,
  shape buckets); device-only wrappers import `habana_frameworks` lazily.

The source lives at the repository root (`kernels/`, as the design card lays out) and is linked
into the Python package as `python/specinfer/kernels -> ../../kernels`; maturin follows the link
when it packs the wheel.
"""

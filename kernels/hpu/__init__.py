"""The Gaudi (HPU) attention path in plain torch: flat block-list paged attention for decodes
(and batch-expanded verification), a bucketed dense path for multi-token queries, shape buckets
with bucket-aware speculation length. Runs on CPU; only `device` needs habana_frameworks, and it
imports it lazily.
"""
from specinfer.kernels.hpu.buckets import BucketConfig, BucketPlanner, bucket_range
from specinfer.kernels.hpu.dense_attention import DenseBlockMetadata, build_dense_metadata, dense_paged_attention
from specinfer.kernels.hpu.flat_attention import FlatBlockMetadata, build_flat_metadata, flat_paged_attention

__all__ = ["BucketConfig", "BucketPlanner", "bucket_range", "DenseBlockMetadata", "build_dense_metadata",
           "dense_paged_attention", "FlatBlockMetadata", "build_flat_metadata", "flat_paged_attention"]

"""What every CUDA-graph runner shares: buckets, staging, capture."""

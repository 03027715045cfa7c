"""The project's own Triton kernels. Each module imports triton itself, so import them lazily."""

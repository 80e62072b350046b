"""Engines: ONNX graph export, engine build (ONNX Runtime / TensorRT), runtime wrappers, manifests."""

# Source or run: make sure the llama.cpp peer venv exists at $LLAMACPP_PEER (default /tmp/llamacpppeer),
# with llama-cpp-python built from its sdist for this CPU and llama.cpp's own HF -> GGUF converter
# extracted from that sdist into $LLAMACPP_PEER/convert/. Heavy (a C++ build): run it under
# `flock /tmp/conveyor_heavy.lock` on a shared box.
LLAMACPP_PEER=${LLAMACPP_PEER:-/tmp/llamacpppeer}
LLCP_VERSION=0.3.36                     # llama-cpp-python; its vendor/llama.cpp is the peer's llama.cpp
LLCP_DL=${LLCP_DL:-/tmp/llcp_dl}        # where the sdist is downloaded (kept: the build and the converter both read it)
SDIST="$LLCP_DL/llama_cpp_python-$LLCP_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  mkdir -p "$LLCP_DL" && pip download -q --no-deps --no-binary :all: -d "$LLCP_DL" "llama-cpp-python==$LLCP_VERSION"
fi
if ! "$LLAMACPP_PEER/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
  python3.11 -m venv "$LLAMACPP_PEER" && "$LLAMACPP_PEER/bin/pip" install -q torch==2.13.0 && \
    "$LLAMACPP_PEER/bin/pip" install -q "numpy<2.5" safetensors "transformers==4.57.6" sentencepiece \
      "protobuf>=4.21,<5" gguf && \
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$LLAMACPP_PEER/bin/pip" install -q --no-binary llama-cpp-python "$SDIST"
fi
if [ ! -f "$LLAMACPP_PEER/convert/convert_hf_to_gguf.py" ]; then
  # the converter is a script plus its conversion/ package and the gguf-py it was written against
  # (it puts convert/gguf-py first on sys.path; the registry's gguf is the fallback)
  mkdir -p "$LLAMACPP_PEER/convert" && \
    tar xzf "$SDIST" -C "$LLAMACPP_PEER/convert" --strip-components=3 \
      "llama_cpp_python-$LLCP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
      "llama_cpp_python-$LLCP_VERSION/vendor/llama.cpp/conversion" \
      "llama_cpp_python-$LLCP_VERSION/vendor/llama.cpp/gguf-py"
fi

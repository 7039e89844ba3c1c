# Sourced by the GPU scripts (benchmarks/*.sh), from the repository's root with $OUT set: installs the project and the
# wheels the GPU image lacks (tensorboardX, tqdm, tokenizers, safetensors; from .whl/, where missing), and writes the
# machine (GPU, driver, memory, JAX, Python, host cores) into $OUT/machine.txt.
: "${OUT:?set OUT to the folder for the results and logs}"
mkdir -p "$OUT"
for pair in tensorboardX:tensorboardx tqdm:tqdm tokenizers:tokenizers safetensors:safetensors; do
  python3 -c "import ${pair%%:*}" 2>/dev/null || python3 -m pip install -q --no-deps .whl/${pair#*:}-*.whl >> "$OUT/pip.log" 2>&1
done
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/pip.log" 2>&1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c "import jax, sys; print('jax', jax.__version__, 'python', sys.version.split()[0])"; nproc; } > "$OUT/machine.txt" 2>&1

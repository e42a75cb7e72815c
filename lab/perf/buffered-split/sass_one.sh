# The check of docs/perf/buffered-split/sass.txt as it ran (paths of that session: /tmp/sass/old held 7262bb0's csrc/arfuse headers).
#!/bin/bash
# $1: buffered twin name (out/kernels). Compares its SASS (HEAD headers) with the instance the
# dispatch of 7262bb0 ran for T <= 64, compiled with 7262bb0's headers.
export PATH=/tmp/cuobj/x/nvidia/cu13/bin:$PATH
cd /work/main; N=$(cat build/nvcc.path); b=$1; base=${b%_upto64}
cp=""
for u in 512 256; do [ -f out/kernels/${base}_upto$u.cu ] && cp=${base}_upto$u && break; done
[ -z "$cp" ] && { grep -q "min_blocks_per_sm=\*/0" out/kernels/$b.cu && grep -q "min_blocks_splits\|upto64" /dev/null; cp=$base; }
# the merged case: the unbound twin of the same range (4096 N = 4/8): compile the same file with the old headers
if grep -q "min_blocks_per_sm=\*/0" out/kernels/$b.cu && ! grep -q "min_blocks_per_sm=\*/0" out/kernels/$base.cu && [ "$cp" = "$base" ]; then cp=$b; fi
sass(){ cuobjdump -sass $1 | grep -E "^\s+/\*[0-9a-f]{4,}\*/" | sed -E 's@/\*[0-9a-f]{4,}\*/@@; s@/\*.*\*/@@g; s/ +/ /g'; }
$N -std=c++17 -O3 -arch=sm_90 -cubin -Icsrc -Iout -DNDEBUG out/kernels/$b.cu -o /tmp/v/$b.new.cubin 2>/dev/null
$N -std=c++17 -O3 -arch=sm_90 -cubin -I/tmp/sass/old -Iout -DNDEBUG out/kernels/$cp.cu -o /tmp/v/$b.old.cubin 2>/dev/null
sass /tmp/v/$b.new.cubin > /tmp/v/$b.new.sass; sass /tmp/v/$b.old.cubin > /tmp/v/$b.old.sass
n=$(wc -l < /tmp/v/$b.new.sass)
if [ "$n" -gt 100 ] && cmp -s /tmp/v/$b.new.sass /tmp/v/$b.old.sass; then echo "SAME-SASS $b vs 7262bb0 $cp ($n instructions)"; else echo "DIFFER $b vs 7262bb0 $cp ($n / $(wc -l < /tmp/v/$b.old.sass))"; fi
rm -f /tmp/v/$b.*.cubin

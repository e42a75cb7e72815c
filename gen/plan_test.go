package main

import (
	"strings"
	"testing"
)

func TestPlanSpecialised(t *testing.T) {
	cases := []planCase{
		// Cluster 4: 896 vectors, 4 CTAs of 224 (8 would leave 112 < 128).
		{"bf16", 7168, Plan{Vec: 8, Nvec: 896, Cluster: 4, Slice: 224, ThreadsPerToken: 224, VecsPerThread: 1, TokensPerBlock: 1, BlockThreads: 224, MaxHidden: 7168, RowInRegisters: true}},
		// gpt-oss-120b: 360 vectors, cluster 2 (4 would leave 90), slice 180 rounds up to 192 threads.
		{"bf16", 2880, Plan{Vec: 8, Nvec: 360, Cluster: 2, Slice: 180, ThreadsPerToken: 192, VecsPerThread: 1, TokensPerBlock: 1, BlockThreads: 192, MaxHidden: 2880, RowInRegisters: true}},
		// fp32 halves the vector: 1792 vectors, cluster 8 of 224.
		{"fp32", 7168, Plan{Vec: 4, Nvec: 1792, Cluster: 8, Slice: 224, ThreadsPerToken: 224, VecsPerThread: 1, TokensPerBlock: 1, BlockThreads: 224, MaxHidden: 7168, RowInRegisters: true}},
		{"bf16", 2048, Plan{Vec: 8, Nvec: 256, Cluster: 2, Slice: 128, ThreadsPerToken: 128, VecsPerThread: 1, TokensPerBlock: 1, BlockThreads: 128, MaxHidden: 2048, RowInRegisters: true}},
		{"fp16", 4096, Plan{Vec: 8, Nvec: 512, Cluster: 4, Slice: 128, ThreadsPerToken: 128, VecsPerThread: 1, TokensPerBlock: 1, BlockThreads: 128, MaxHidden: 4096, RowInRegisters: true}},
		// Small rows: one CTA per token, several tokens per block.
		{"bf16", 512, Plan{Vec: 8, Nvec: 64, Cluster: 1, Slice: 64, ThreadsPerToken: 64, VecsPerThread: 1, TokensPerBlock: 2, BlockThreads: 128, MaxHidden: 512, RowInRegisters: true}},
		{"bf16", 8, Plan{Vec: 8, Nvec: 1, Cluster: 1, Slice: 1, ThreadsPerToken: 32, VecsPerThread: 1, TokensPerBlock: 4, BlockThreads: 128, MaxHidden: 8, RowInRegisters: true}},
		// Odd vector count: no cluster divides it, 256 threads hold 4 vectors each.
		{"fp16", 8184, Plan{Vec: 8, Nvec: 1023, Cluster: 1, Slice: 1023, ThreadsPerToken: 256, VecsPerThread: 4, TokensPerBlock: 1, BlockThreads: 256, MaxHidden: 8184, RowInRegisters: true}},
		{"bf16", 65536, Plan{Vec: 8, Nvec: 8192, Cluster: 8, Slice: 1024, ThreadsPerToken: 256, VecsPerThread: 4, TokensPerBlock: 1, BlockThreads: 256, MaxHidden: 65536, RowInRegisters: true}},
	}
	checkPlans(t, "oneshot", cases)
}

func TestPlanRejects(t *testing.T) {
	cases := []struct {
		dtype  string
		hidden int
		want   string
	}{
		{"fp32", 8196, "fp32 row needs 9 vectors per thread (max 8): it would not stay in registers"},
		{"bf16", 1004, "hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)"},
		{"fp32", 1002, "hidden size not a multiple of the fp32 vector width 4 (16-byte vectors)"},
		{"bf16", 0, "hidden size out of range (want 1 to 65536)"},
		{"fp16", 65544, "hidden size out of range (want 1 to 65536)"},
	}
	for _, c := range cases {
		_, err := planSpecialised(dtypeByName(c.dtype), c.hidden, algoByName("oneshot"))
		if err == nil || err.Error() != c.want {
			t.Errorf("%s %d: got %v, want %q", c.dtype, c.hidden, err, c.want)
		}
	}
}

// Two-shot: one CTA per token, up to 512 threads, no cluster while the row fits in registers.
func TestPlanTwoShot(t *testing.T) {
	cases := []planCase{
		// 896 vectors: 2 per thread, 448 threads.
		{"bf16", 7168, Plan{Vec: 8, Nvec: 896, Cluster: 1, Slice: 896, ThreadsPerToken: 448, VecsPerThread: 2, TokensPerBlock: 1, BlockThreads: 448, MaxHidden: 7168, RowInRegisters: true, MinBlocksPerSM: 2}},
		// At least 2 vectors per thread: 512 vectors on 256 threads, not 512 threads of 1; four
		// blocks per SM asked (twoShotMinBlocks, measured).
		{"bf16", 4096, Plan{Vec: 8, Nvec: 512, Cluster: 1, Slice: 512, ThreadsPerToken: 256, VecsPerThread: 2, TokensPerBlock: 1, BlockThreads: 256, MaxHidden: 4096, RowInRegisters: true, MinBlocksPerSM: 4}},
		{"bf16", 2880, Plan{Vec: 8, Nvec: 360, Cluster: 1, Slice: 360, ThreadsPerToken: 192, VecsPerThread: 2, TokensPerBlock: 1, BlockThreads: 192, MaxHidden: 2880, RowInRegisters: true, MinBlocksPerSM: 5}},
		{"bf16", 2048, Plan{Vec: 8, Nvec: 256, Cluster: 1, Slice: 256, ThreadsPerToken: 128, VecsPerThread: 2, TokensPerBlock: 1, BlockThreads: 128, MaxHidden: 2048, RowInRegisters: true}},
		{"fp32", 7168, Plan{Vec: 4, Nvec: 1792, Cluster: 1, Slice: 1792, ThreadsPerToken: 448, VecsPerThread: 4, TokensPerBlock: 1, BlockThreads: 448, MaxHidden: 7168, RowInRegisters: true, MinBlocksPerSM: 2}},
		{"bf16", 512, Plan{Vec: 8, Nvec: 64, Cluster: 1, Slice: 64, ThreadsPerToken: 32, VecsPerThread: 2, TokensPerBlock: 4, BlockThreads: 128, MaxHidden: 512, RowInRegisters: true}},
		// A row of one warp's vectors or fewer: one vector per thread.
		{"bf16", 8, Plan{Vec: 8, Nvec: 1, Cluster: 1, Slice: 1, ThreadsPerToken: 32, VecsPerThread: 1, TokensPerBlock: 4, BlockThreads: 128, MaxHidden: 8, RowInRegisters: true}},
		// Too long for 512 threads x 8 vectors: the clustered plan of one-shot (256 threads, but 4
		// vectors each: not the measured shape of twoShotMinBlocks).
		{"bf16", 65536, Plan{Vec: 8, Nvec: 8192, Cluster: 8, Slice: 1024, ThreadsPerToken: 256, VecsPerThread: 4, TokensPerBlock: 1, BlockThreads: 256, MaxHidden: 65536, RowInRegisters: true}},
	}
	checkPlans(t, "twoshot", cases)
}

type planCase struct {
	dtype  string
	hidden int
	want   Plan
}

func checkPlans(t *testing.T, algo string, cases []planCase) {
	t.Helper()
	for _, c := range cases {
		got, err := planSpecialised(dtypeByName(c.dtype), c.hidden, algoByName(algo))
		if err != nil {
			t.Errorf("%s %s %d: %v", algo, c.dtype, c.hidden, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s %s %d:\n got %+v\nwant %+v", algo, c.dtype, c.hidden, got, c.want)
		}
	}
}

// Every hidden size the plan accepts gives a shape the device code can run.
func TestPlanInvariants(t *testing.T) {
	for _, algo := range algos {
		for _, dt := range dtypes {
			for h := dt.Vec(); h <= maxHidden; h += dt.Vec() {
				p, err := planSpecialised(dt, h, algo)
				if err != nil {
					if !strings.Contains(err.Error(), "registers") {
						t.Fatalf("%s %s %d: %v", algo.Name, dt.Name, h, err)
					}
					continue
				}
				limit := 256
				if algo.Name == "twoshot" {
					limit = twoShotMaxThreads
				}
				ok := p.Cluster*p.Slice == p.Nvec && p.ThreadsPerToken%32 == 0 && p.ThreadsPerToken <= limit &&
					p.ThreadsPerToken*p.VecsPerThread >= p.Slice && p.VecsPerThread <= maxVecsPerThread &&
					p.BlockThreads <= limit && p.BlockThreads == p.ThreadsPerToken*p.TokensPerBlock &&
					(p.Cluster == 1 || p.Slice >= 128)
				if !ok {
					t.Fatalf("%s %s %d: bad plan %+v", algo.Name, dt.Name, h, p)
				}
			}
		}
	}
}

func TestPlanGeneric(t *testing.T) {
	for dt, maxH := range map[string]int{"bf16": 32768, "fp16": 32768, "fp32": 16384} {
		p := planGeneric(dtypeByName(dt))
		want := Plan{Vec: 16 / dtypeByName(dt).Size, Cluster: 1, VecsPerThread: 8, TokensPerBlock: 1, MaxHidden: maxH, RowInRegisters: true}
		if p != want {
			t.Errorf("%s: got %+v want %+v", dt, p, want)
		}
	}
}

func TestNames(t *testing.T) {
	if got := variantName(dtypeByName("bf16"), 7168, 8, algoByName("oneshot"), outKindByName("norm")); got != "arfuse_bf16_h7168_w8_oneshot_norm" {
		t.Errorf("specialised name %q", got)
	}
	if got := genericName(dtypeByName("bf16"), algoByName("oneshot"), outKindByName("norm")); got != "arfuse_bf16_generic_oneshot_norm" {
		t.Errorf("generic name %q", got)
	}
	if got := variantName(dtypeByName("fp32"), 2880, 16, algoByName("twoshot"), outKindByName("fp8_static")); got != "arfuse_fp32_h2880_w16_twoshot_fp8_static" {
		t.Errorf("fp8 name %q", got)
	}
}

// Each (dtype, hidden size, algorithm) is planned once, however many groups, world sizes and
// output kinds (fp8_group128 among them, whose rule needs the plan) ask for it; each dtype's
// generic instance once.
func TestPlannedOnce(t *testing.T) {
	p := writeTemp(t, t.TempDir(), "m.yaml", `
groups:
  - models: [deepseek-v3, deepseek-r1]
    hidden: [2048]
    dtypes: [bf16, fp16]
    world_sizes: [2, 8]
    algorithms: [oneshot, twoshot]
    outputs: [norm, fp8_token, fp8_group128]
  - hidden: [7168, 4096]
    dtypes: [bf16]
    world_sizes: [4]
    algorithms: [oneshot, twoshot]
    outputs: [fp8_group128, fp8_static]
generic: true
`)
	m, err := loadMatrix(p, testModels(t))
	if err != nil {
		t.Fatal(err)
	}
	pl := newPlanner()
	vs, err := pl.expand(m)
	if err != nil {
		t.Fatal(err)
	}
	// Specialised: {7168, 2048} x {bf16, fp16} x 2 algorithms, plus 4096 bf16 x 2; generic: bf16, fp16.
	if want := 2*2*2 + 2 + 2; pl.calls != want {
		t.Errorf("%d plans computed for %d variants, want %d (one per distinct key)", pl.calls, len(vs), want)
	}
	for _, v := range vs {
		if v.Generic {
			continue
		}
		if want, _ := planSpecialised(v.DType, v.Hidden, v.Algo); v.Plan != want {
			t.Errorf("%s: plan %+v, want %+v", v.Name, v.Plan, want)
		}
	}
}

// splitByTokens: the unbound twins of min_blocks_splits and the buffered twins of buffered_splits.
// A buffered twin is built unbound where the instance has an unbound twin (that range ran
// unbound), with the plan's own bound where it has none, and where both name the same token count
// the unbound twin becomes the buffered one (one instance, not two of one name).
func TestSplitByTokensBuffered(t *testing.T) {
	bf16, two := dtypeByName("bf16"), algoByName("twoshot")
	norm := outKindByName("norm")
	variant := func(hidden, world int) *Variant {
		p, err := planSpecialised(bf16, hidden, two)
		if err != nil {
			t.Fatal(err)
		}
		return &Variant{Name: variantName(bf16, hidden, world, two, norm), DType: bf16, Hidden: hidden,
			World: world, Algo: two, Out: norm, Plan: p}
	}
	row := func(hidden, world, max int) Split {
		return Split{RowAxes: RowAxes{DType: bf16, Hidden: hidden, World: world}, Algo: two, Out: norm, MaxTokens: max}
	}
	tu := &Tuning{
		Splits:   SplitTable{Rows: []Split{row(4096, 2, 256), row(4096, 8, 64)}},
		Buffered: SplitTable{Rows: []Split{row(4096, 2, 64), row(4096, 8, 64), row(7168, 8, 64), row(2048, 4, 64)}},
	}
	got := splitByTokens([]*Variant{variant(4096, 2), variant(4096, 8), variant(7168, 8)}, tu)
	type want struct {
		max, minBlocks int
		buffered       bool
	}
	wants := map[string]want{
		"arfuse_bf16_h4096_w2_twoshot_norm":         {0, 4, false},
		"arfuse_bf16_h4096_w2_twoshot_norm_upto256": {256, 0, false},
		"arfuse_bf16_h4096_w2_twoshot_norm_upto64":  {64, 0, true}, // unbound: the upto256 twin ran there
		"arfuse_bf16_h4096_w8_twoshot_norm":         {0, 4, false},
		"arfuse_bf16_h4096_w8_twoshot_norm_upto64":  {64, 0, true}, // the unbound twin, now buffered
		"arfuse_bf16_h7168_w8_twoshot_norm":         {0, 2, false},
		"arfuse_bf16_h7168_w8_twoshot_norm_upto64":  {64, 2, true}, // no unbound twin: the plan's bound
	} // 2048 N = 4 is not in the matrix: no twin
	if len(got) != len(wants) {
		t.Fatalf("%d variants, want %d", len(got), len(wants))
	}
	for _, v := range got {
		w, ok := wants[v.Name]
		if !ok {
			t.Errorf("unexpected variant %s", v.Name)
			continue
		}
		if v.MaxTokens != w.max || v.Plan.MinBlocksPerSM != w.minBlocks || v.Buffered != w.buffered {
			t.Errorf("%s: max_tokens %d, min_blocks %d, buffered %v; want %d, %d, %v",
				v.Name, v.MaxTokens, v.Plan.MinBlocksPerSM, v.Buffered, w.max, w.minBlocks, w.buffered)
		}
	}
}

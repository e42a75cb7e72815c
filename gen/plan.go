package main

// The plan: every per-variant decision the device code relies on (vector width, cluster size,
// threads and vectors per token, block shape) is taken here, in Go, and only printed by the
// templates; and every feasibility rule (which hidden sizes can be built for which dtype,
// algorithm and output kind, a variant produced twice, a tuning row for a size no plan serves)
// is checked here, reported at the place in the input that the model recorded (Where). Each
// (dtype, hidden size, algorithm) is planned once (planner). Do not change these rules without
// changing csrc/arfuse/kernel.cuh with them.

import (
	"fmt"
	"slices"
	"sort"
	"strings"
)

// Plan is the kernel shape of one variant.
type Plan struct {
	Vec             int  // elements per 16-byte vector
	Nvec            int  // vectors per row (0: generic)
	Cluster         int  // CTAs per token (thread-block cluster size)
	Slice           int  // vectors per CTA per token (0: generic)
	ThreadsPerToken int  // 0: chosen at launch (generic)
	VecsPerThread   int  // vectors each thread keeps in registers (the maximum when generic)
	TokensPerBlock  int  // tokens one CTA handles
	BlockThreads    int  // 0: chosen at launch (generic)
	MaxHidden       int  // largest hidden size served
	RowInRegisters  bool // the whole row slice stays in registers
	MinBlocksPerSM  int  // blocks per SM the registers must leave room for (0: ptxas's choice)
}

// Variant is one kernel instance: its axes, its one name and its plan.
type Variant struct {
	Name    string
	Generic bool
	DType   *DType
	Hidden  int // 0: run-time (generic)
	World   int // 0: run-time (generic)
	Algo    *Algo
	Out     *OutKind
	Models  []string // models whose hidden size this is, sorted
	Plan    Plan
	// MaxTokens: 0, the instance serves every token count; else it is a token split's twin
	// (splitByTokens), served for T <= MaxTokens, its sibling above.
	MaxTokens int
	// Buffered: a two-shot twin of buffered_splits, whose owner sends its own tokens' partials and
	// gathered rows through its own buffer (the two-shot of before 3f9a5cd) instead of keeping
	// them in registers (KernelConfig::kOwnInRegs, csrc/arfuse/kernel.cuh).
	Buffered bool
}

// variantName is the one name of a variant: file name, symbol, dispatch key and --only key.
func variantName(dt *DType, hidden, world int, algo *Algo, out *OutKind) string {
	return fmt.Sprintf("arfuse_%s_h%d_w%d_%s_%s", dt.Name, hidden, world, algo.Name, out.Name)
}

func genericName(dt *DType, algo *Algo, out *OutKind) string {
	return fmt.Sprintf("arfuse_%s_generic_%s_%s", dt.Name, algo.Name, out.Name)
}

// hiddenRule returns why hidden cannot be specialised for dt, or "" if it can be.
func hiddenRule(dt *DType, hidden int) string {
	switch {
	case hidden <= 0 || hidden > maxHidden:
		return fmt.Sprintf("hidden size out of range (want 1 to %d)", maxHidden)
	case hidden%dt.Vec() != 0:
		return fmt.Sprintf("hidden size not a multiple of the %s vector width %d (16-byte vectors)", dt.Name, dt.Vec())
	}
	return ""
}

// worldRule returns why algo cannot serve world size world, or "" if it can: world size 1 has no
// all-reduce and is the local algorithm's alone; the all-reduce algorithms serve 2 and up.
func worldRule(algo *Algo, world int) string {
	switch {
	case algo.Local && world != 1:
		return fmt.Sprintf("algorithm %s is the world-size-1 op (no all-reduce): world size %d needs an all-reduce algorithm (%s)",
			algo.Name, world, allReduceAlgoNames())
	case !algo.Local && world == 1:
		return fmt.Sprintf("world size 1 has no all-reduce: it is served by algorithm %s, not %s", localAlgo().Name, algo.Name)
	}
	return ""
}

func localAlgo() *Algo {
	for _, a := range algos {
		if a.Local {
			return a
		}
	}
	return nil
}

func allReduceAlgoNames() string {
	var s []string
	for _, a := range algos {
		if !a.Local {
			s = append(s, a.Name)
		}
	}
	return strings.Join(s, " or ")
}

// planSpecialised plans a variant with hidden size and world size fixed at compile time, or
// returns why it cannot be built.
//
// The local algorithm (world size 1) is planned as one-shot is: its kernel is the one-shot body
// without the exchange (finalize, residual and norm of a token in one pass, the row in
// registers), and splitting a token's row over a cluster spreads its loads over several SMs
// where T is small, while at large T the clusters of many tokens fill the GPU anyway.
//
// One-shot serves the small token counts, where latency is one token's: a token's row is split
// over a thread-block cluster (the largest of clusterSizes, 8/4/2 CTAs, that divides the row and
// leaves each CTA at least 128 vectors), so that one token's loads come from several SMs at once. Two-shot serves
// the large token counts, where there are tokens enough for every SM and throughput is what
// counts: one CTA per token (no cluster, so no cluster barriers per token and no cluster-shaped
// limit on co-residency), each thread keeping at least twoShotMinVecs vectors of the row (so that
// it issues twoShotMinVecs * (K + 1) independent 16-byte loads before its first use), at most
// twoShotMaxThreads threads. Measured on the H200 (lab/perf/history.md): the clustered two-shot
// moved its bytes at 53-60 % of the copy bandwidth at T >= 1024; one CTA per token reached 85 %
// with 2 vectors per thread (H = 7168) but stayed at 61 % with 1 (H = 4096, 512 threads).
// twoShotMinVecs is the fewest vectors a two-shot thread keeps, where the row has enough of them
// to give every thread of a warp that many.
const twoShotMinVecs = 2

// clusterMinSlice: the fewest vectors of a row each CTA of a one-shot (and local) cluster takes.
const clusterMinSlice = 128

func planSpecialised(dt *DType, hidden int, algo *Algo) (Plan, error) {
	if rule := hiddenRule(dt, hidden); rule != "" {
		return Plan{}, fmt.Errorf("%s", rule)
	}
	p := Plan{Vec: dt.Vec(), MaxHidden: hidden}
	p.Nvec = hidden / p.Vec
	p.Cluster = 1
	if algo.Name == "twoshot" && ceilDiv(p.Nvec, twoShotMaxThreads) <= maxVecsPerThread {
		p.Slice = p.Nvec
		p.VecsPerThread = max(ceilDiv(p.Nvec, twoShotMaxThreads), min(twoShotMinVecs, ceilDiv(p.Nvec, 32)))
		p.ThreadsPerToken = roundUp(ceilDiv(p.Nvec, p.VecsPerThread), 32)
	} else { // one-shot, and two-shot rows too long for one CTA's registers
		for _, c := range clusterSizes {
			if p.Nvec%c == 0 && p.Nvec/c >= clusterMinSlice {
				p.Cluster = c
				break
			}
		}
		p.Slice = p.Nvec / p.Cluster
		p.ThreadsPerToken = min(roundUp(p.Slice, 32), 256)
		p.VecsPerThread = ceilDiv(p.Slice, p.ThreadsPerToken)
	}
	if p.VecsPerThread > maxVecsPerThread {
		return Plan{}, fmt.Errorf("%s row needs %d vectors per thread (max %d): it would not stay in registers",
			dt.Name, p.VecsPerThread, maxVecsPerThread)
	}
	p.RowInRegisters = true
	p.TokensPerBlock = max(1, 128/p.ThreadsPerToken)
	p.BlockThreads = p.ThreadsPerToken * p.TokensPerBlock
	if p.BlockThreads > minBlocksAbove {
		p.MinBlocksPerSM = 2
	}
	if n, ok := twoShotMinBlocks[p.BlockThreads]; ok && algo.Name == "twoshot" && p.Cluster == 1 &&
		p.VecsPerThread == 2 {
		p.MinBlocksPerSM = n
	}
	return p, nil
}

// twoShotMinBlocks: blocks per SM asked of two-shot instances of the one-CTA,
// 2-vectors-per-thread shape, by block size, where a measurement showed that the occupancy pays.
// The two-shot at large T is bandwidth-bound and its bytes in flight grow with the threads
// resident: at 256 threads (H = 4096) ptxas chose 74 registers, three blocks per SM; asked for
// four (64 registers), Qwen3-235B moved T = 8192 7-10 % faster at N = 2, 4, 8 (N = 4: 1,286 ->
// 1,160 us), and was 2-8 % slower at a few mid T with few tokens per owner (N = 2 T = 256,
// N = 8 T = 16-64) (kernel_ab on the H200 at 187a843, lab/perf/history.md). At 192 threads
// (H = 2880) five blocks (64 registers, 36-140 bytes spilled) moved gpt-oss-120b T = 8192 3-8 %
// faster than ptxas's four (H200 kernel22, H100 50fc694) and cost up to 10 % at T = 128-512:
// the token splits of variants/tuning.yaml serve the unbound twin there. 128 threads (H = 2048)
// is not in the table: 8 blocks would cap at 64 registers, where that instance already spills
// at 72, and the 6-blocks A/B (kernel22) was 2-3 % slower at T >= 1024.
var twoShotMinBlocks = map[int]int{256: 4, 192: 5}

// minBlocksAbove: blocks of more threads than this are compiled for two blocks per SM
// (__launch_bounds__(threads, 2): at most 65536 / (2 * threads) registers, 72 at 448 threads).
// Without it ptxas gave the 448-thread two-shot FP8 instances of H = 7168 96 registers, which
// leaves room for one block per SM (43,008 of 65,536 registers) where their grid is sized for
// two (lab/perf/history.md). Blocks of 256 threads or fewer fit two per SM at up to 128
// registers, so they need no bound.
const minBlocksAbove = 256

// planGeneric plans the generic instance of a dtype: shape chosen at launch from the run-time
// hidden size, one CTA per token, up to the register limit.
func planGeneric(dt *DType) Plan {
	return Plan{
		Vec:            dt.Vec(),
		Cluster:        1,
		VecsPerThread:  maxVecsPerThread,
		TokensPerBlock: 1,
		MaxHidden:      genericMaxThreads * maxVecsPerThread * dt.Vec(),
		RowInRegisters: true,
	}
}

func roundUp(x, m int) int { return ceilDiv(x, m) * m }
func ceilDiv(x, m int) int { return (x + m - 1) / m }

// groupSizeRule returns why output kind o (with quantization groups) cannot be built at this
// hidden size whatever the plan, or "" if it can.
func groupSizeRule(hidden int, o *OutKind) string {
	if o.Group != 0 && hidden%o.Group != 0 {
		return fmt.Sprintf("%s needs a hidden size that is a multiple of %d (one FP8 scale per group of %d elements)", o.Name, o.Group, o.Group)
	}
	return ""
}

// groupPlanRule returns why the specialised plan p cannot serve output kind o, or "" if it can.
// The kernel reduces a group's amax over Group/Vec aligned consecutive lanes of one warp
// (csrc/arfuse/writers.cuh, the group writer), so each CTA's slice of the row, and the threads per
// token, must be whole groups of vectors.
func groupPlanRule(dt *DType, algo *Algo, o *OutKind, p Plan) string {
	if o.Group == 0 {
		return ""
	}
	gv := o.Group / p.Vec
	if p.Slice%gv != 0 || p.ThreadsPerToken%gv != 0 {
		return fmt.Sprintf("%s: the %s %s plan gives each CTA %d vectors and %d threads per token, not whole groups of %d vectors (%d elements)",
			o.Name, dt.Name, algo.Name, p.Slice, p.ThreadsPerToken, gv, o.Group)
	}
	return ""
}

// planKey is what a specialised plan depends on.
type planKey struct {
	dt     *DType
	hidden int
	algo   *Algo
}

type planned struct {
	plan Plan
	err  error
}

// planner plans each (dtype, hidden size, algorithm) once, and each dtype's generic instance
// once, however many groups, world sizes and output kinds ask for it.
type planner struct {
	specialised map[planKey]planned
	generic     map[*DType]Plan
	calls       int // plans computed (not looked up): one per distinct key
}

func newPlanner() *planner {
	return &planner{specialised: map[planKey]planned{}, generic: map[*DType]Plan{}}
}

func (pl *planner) plan(dt *DType, hidden int, algo *Algo) (Plan, error) {
	k := planKey{dt, hidden, algo}
	r, ok := pl.specialised[k]
	if !ok {
		pl.calls++
		r.plan, r.err = planSpecialised(dt, hidden, algo)
		pl.specialised[k] = r
	}
	return r.plan, r.err
}

func (pl *planner) planGeneric(dt *DType) Plan {
	p, ok := pl.generic[dt]
	if !ok {
		pl.calls++
		p = planGeneric(dt)
		pl.generic[dt] = p
	}
	return p
}

// hiddenError reports a rule broken by hidden entry h, naming the model whose size it is.
func hiddenError(h HiddenEntry, rule string) error {
	if h.Model != "" {
		rule = fmt.Sprintf("hidden %d of this model: %s", h.Hidden, rule)
	}
	return h.At.Errorf("%s", rule)
}

// groupPlan plans hidden entry h of a group for dt and algo, checking it against every output
// kind outs asks for: a size no quantization group fits first, then the plan's own rules, then
// the groups against the plan.
func (pl *planner) groupPlan(dt *DType, h HiddenEntry, algo *Algo, outs []*OutKind) (Plan, error) {
	for _, o := range outs {
		if rule := groupSizeRule(h.Hidden, o); rule != "" {
			return Plan{}, hiddenError(h, rule)
		}
	}
	p, err := pl.plan(dt, h.Hidden, algo)
	if err != nil {
		return Plan{}, hiddenError(h, err.Error())
	}
	for _, o := range outs {
		if rule := groupPlanRule(dt, algo, o, p); rule != "" {
			return Plan{}, hiddenError(h, rule)
		}
	}
	return p, nil
}

// expand turns a matrix into its variants, sorted by name. A variant produced twice, a hidden
// size the plan rejects and a matrix that produces nothing are errors located in the file.
func expand(m *Matrix) ([]*Variant, error) { return newPlanner().expand(m) }

func (pl *planner) expand(m *Matrix) ([]*Variant, error) {
	type origin struct {
		path string
		line int
	}
	seen := map[string]origin{}
	var out []*Variant
	add := func(v *Variant, o origin) error {
		if first, dup := seen[v.Name]; dup {
			rule := fmt.Sprintf("duplicate variant (%s at line %d produces it too)", first.path, first.line)
			if first.path == o.path {
				rule = "duplicate variant (produced twice by this group)"
			}
			return &InputError{File: m.File, Line: o.line, Path: o.path, Value: fmt.Sprintf("%q", v.Name), Rule: rule}
		}
		seen[v.Name] = o
		out = append(out, v)
		return nil
	}
	type combo struct {
		dt   *DType
		algo *Algo
		out  *OutKind
	}
	var used []combo
	for _, g := range m.Groups {
		// Every world size of the group must be served by every algorithm of it (a group is a
		// cross product: world size 1 goes in a group of its own, with algorithm local).
		for i, w := range g.Worlds {
			for _, algo := range g.Algos {
				if rule := worldRule(algo, w); rule != "" {
					return nil, g.WorldsAt[i].Errorf("%s (give world size 1 a group of its own)", rule)
				}
			}
		}
		// Hidden sizes of one group form a set: two models may share a size (DeepSeek-V3/R1).
		var sizes []int
		models := map[int][]string{}
		for _, h := range g.Hiddens {
			if !slices.Contains(sizes, h.Hidden) {
				sizes = append(sizes, h.Hidden)
			}
			if h.Model != "" {
				models[h.Hidden] = append(models[h.Hidden], h.Model)
			}
		}
		for _, dt := range g.DTypes {
			type key struct {
				hidden int
				algo   *Algo
			}
			plans := map[key]Plan{}
			for _, h := range g.Hiddens {
				for _, algo := range g.Algos {
					p, err := pl.groupPlan(dt, h, algo, g.Outs)
					if err != nil {
						return nil, err
					}
					plans[key{h.Hidden, algo}] = p
				}
			}
			for _, algo := range g.Algos {
				for _, o := range g.Outs {
					if !slices.Contains(used, combo{dt, algo, o}) {
						used = append(used, combo{dt, algo, o})
					}
					for _, h := range sizes {
						for _, w := range g.Worlds {
							ms := slices.Clone(models[h])
							slices.Sort(ms)
							v := &Variant{
								Name: variantName(dt, h, w, algo, o), DType: dt, Hidden: h, World: w,
								Algo: algo, Out: o, Models: ms, Plan: plans[key{h, algo}],
							}
							if err := add(v, origin{g.Path, g.Line}); err != nil {
								return nil, err
							}
						}
					}
				}
			}
		}
	}
	generic := func(c combo, o origin) error {
		return add(&Variant{
			Name: genericName(c.dt, c.algo, c.out), Generic: true, DType: c.dt,
			Algo: c.algo, Out: c.out, Plan: pl.planGeneric(c.dt),
		}, o)
	}
	if m.Generic.Auto {
		for _, c := range used {
			if err := generic(c, origin{"generic", m.Generic.Line}); err != nil {
				return nil, err
			}
		}
	}
	for _, g := range m.Generic.Groups {
		for _, dt := range g.DTypes {
			for _, algo := range g.Algos {
				for _, o := range g.Outs {
					if err := generic(combo{dt, algo, o}, origin{g.Path, g.Line}); err != nil {
						return nil, err
					}
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// checkTuning applies the plan's hidden-size rule to every measured threshold row: a row for a
// size no specialised plan serves is a mistake in the tuning file. A token split's row must name
// an instance the plan can build and whose plan asks for a blocks-per-SM bound (else there is
// nothing to build without it).
func checkTuning(t *Tuning) error {
	rows := slices.Clone(t.Rows)
	for _, c := range t.Cards {
		rows = append(rows, c.Rows...)
	}
	for _, r := range rows {
		if r.World == 1 {
			return r.WorldAt.Errorf("world size 1 runs algorithm %s only: there is no one-shot/two-shot threshold to tune", localAlgo().Name)
		}
		if rule := hiddenRule(r.DType, r.Hidden); rule != "" {
			return r.HiddenAt.Errorf("%s", rule)
		}
	}
	for _, r := range t.Splits.Rows {
		p, err := splitPlan(r)
		if err != nil {
			return err
		}
		if p.MinBlocksPerSM == 0 {
			return r.At.Errorf("the plan of %s asks for no blocks-per-SM bound: there is no unbound twin to build (plan.go: twoShotMinBlocks, minBlocksAbove)",
				variantName(r.DType, r.Hidden, r.World, r.Algo, r.Out))
		}
	}
	for _, r := range t.Buffered.Rows {
		if r.Algo.Name != "twoshot" {
			return r.At.Errorf("algorithm %s has no owner: a buffered twin is two-shot's (the owner's own tokens through its own buffer)", r.Algo.Name)
		}
		if _, err := splitPlan(r); err != nil {
			return err
		}
		// The buffered twin serves the lowest token counts: where the same instance also has an
		// unbound twin, that twin must serve at least as far (the buffered twin is then built
		// unbound too, as the dispatch ran that range before).
		for _, u := range t.Splits.Rows {
			if u.DType == r.DType && u.Hidden == r.Hidden && u.World == r.World && u.Algo == r.Algo &&
				u.Out == r.Out && u.MaxTokens < r.MaxTokens {
				return r.At.Errorf("buffered_max_tokens %d is above the unbound twin's %d (min_blocks_splits): the buffered twin must serve the lowest token counts",
					r.MaxTokens, u.MaxTokens)
			}
		}
	}
	return nil
}

// splitPlan is the plan of a token-split row's instance, or why the plan cannot build it (at the
// row's world size or hidden size).
func splitPlan(r Split) (Plan, error) {
	if rule := worldRule(r.Algo, r.World); rule != "" {
		return Plan{}, r.WorldAt.Errorf("%s", rule)
	}
	if rule := groupSizeRule(r.Hidden, r.Out); rule != "" {
		return Plan{}, r.HiddenAt.Errorf("%s", rule)
	}
	p, err := planSpecialised(r.DType, r.Hidden, r.Algo)
	if err != nil {
		return Plan{}, r.HiddenAt.Errorf("%s", err)
	}
	if rule := groupPlanRule(r.DType, r.Algo, r.Out, p); rule != "" {
		return Plan{}, r.HiddenAt.Errorf("%s", rule)
	}
	return p, nil
}

// splitByTokens adds, for every token-split row of the tuning file whose instance the matrix
// builds, that instance's twin, served for T <= the row's token count (the dispatch table,
// csrc/dispatch.cpp find_instance, runs the twin with the smallest such count that covers T):
//
//   - min_blocks_splits: the same plan without the blocks-per-SM bound (ptxas's own register
//     choice). A bound that buys occupancy with spills pays where T is large enough to fill the
//     GPU and costs where it is not: the 256-thread two-shot plan at H = 4096 (twoShotMinBlocks)
//     is 7-10 % faster at T >= 1024 with it and up to 8 % slower at mid T (kernel-ab-187a843,
//     lab/perf/history.md).
//   - buffered_splits: the two-shot whose owner sends its own tokens through its own buffer
//     (Variant.Buffered). Keeping them in registers (3f9a5cd) moved T >= 256 5-23 % faster and
//     T = 16-64 at world sizes 4 and 8 up to 25 % slower (lab/perf/h100-3f9a5cd), until the
//     unbound instances finalized their own tokens before their polls (kOwnFirst, a6de6df's A/B):
//     the rows are left for the bound ones (7168). Where the
//     instance also has an unbound twin, the buffered one is unbound too (that range ran unbound);
//     where both name the same token count, the unbound twin becomes the buffered one.
func splitByTokens(variants []*Variant, t *Tuning) []*Variant {
	out := slices.Clone(variants)
	for _, r := range t.Splits.Rows {
		name := variantName(r.DType, r.Hidden, r.World, r.Algo, r.Out)
		i := slices.IndexFunc(variants, func(v *Variant) bool { return v.Name == name })
		if i < 0 {
			continue // the matrix does not build this instance
		}
		twin := *variants[i]
		twin.Name = twinName(name, r.MaxTokens)
		twin.Models = slices.Clone(twin.Models)
		twin.Plan.MinBlocksPerSM = 0
		twin.MaxTokens = r.MaxTokens
		out = append(out, &twin)
	}
	for _, r := range t.Buffered.Rows {
		name := variantName(r.DType, r.Hidden, r.World, r.Algo, r.Out)
		i := slices.IndexFunc(variants, func(v *Variant) bool { return v.Name == name })
		if i < 0 {
			continue
		}
		if j := slices.IndexFunc(out, func(v *Variant) bool { return v.Name == twinName(name, r.MaxTokens) }); j >= 0 {
			out[j].Buffered = true // the unbound twin of the same range
			continue
		}
		twin := *variants[i]
		twin.Name = twinName(name, r.MaxTokens)
		twin.Models = slices.Clone(twin.Models)
		twin.MaxTokens = r.MaxTokens
		twin.Buffered = true
		for _, u := range t.Splits.Rows {
			if variantName(u.DType, u.Hidden, u.World, u.Algo, u.Out) == name {
				twin.Plan.MinBlocksPerSM = 0 // checkTuning: the unbound twin serves this range too
			}
		}
		out = append(out, &twin)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// twinName is the one name of a token split's twin: its sibling's name and the largest T it serves.
func twinName(name string, maxTokens int) string { return fmt.Sprintf("%s_upto%d", name, maxTokens) }

package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// writeTemp writes content to dir/name and returns the path.
func writeTemp(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func testModels(t *testing.T) []*Model {
	t.Helper()
	m, err := loadModels("testdata/models.yaml")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// expandText loads a matrix given as text and expands it.
func expandText(t *testing.T, text string) ([]*Variant, error) {
	t.Helper()
	p := writeTemp(t, t.TempDir(), "m.yaml", text)
	m, err := loadMatrix(p, testModels(t))
	if err != nil {
		return nil, err
	}
	return expand(m)
}

// stripFile removes the temporary file name from an error, leaving ":line: path: value: rule".
func stripFile(err error) string {
	if err == nil {
		return "<nil>"
	}
	s := err.Error()
	if i := strings.Index(s, "m.yaml"); i >= 0 {
		return s[i+len("m.yaml"):]
	}
	if i := strings.Index(s, "t.yaml"); i >= 0 {
		return s[i+len("t.yaml"):]
	}
	return s
}

func names(vs []*Variant) []string {
	var s []string
	for _, v := range vs {
		s = append(s, v.Name)
	}
	return s
}

func TestMatrixAccepts(t *testing.T) {
	cases := []struct {
		name, text string
		want       []string
	}{
		{"models sharing a hidden size and a raw duplicate of it are one size", `
groups:
  - models: [deepseek-v3, deepseek-r1]
    hidden: [7168]
    dtypes: [bf16]
    world_sizes: [8]
    algorithms: [oneshot]
    outputs: [norm]
`, []string{"arfuse_bf16_h7168_w8_oneshot_norm"}},
		{"generic true follows the groups", `
groups:
  - hidden: [2048]
    dtypes: [fp16]
    world_sizes: [2]
    algorithms: [twoshot]
    outputs: [fp8_static]
generic: true
`, []string{"arfuse_fp16_generic_twoshot_fp8_static", "arfuse_fp16_h2048_w2_twoshot_fp8_static"}},
		{"generic false and anchors", `
groups:
  - &g
    hidden: [2048]
    dtypes: &d [fp32]
    world_sizes: [16]
    algorithms: [oneshot]
    outputs: [norm]
  - hidden: [4096]
    dtypes: *d
    world_sizes: [16]
    algorithms: [oneshot]
    outputs: [norm]
generic: false
`, []string{"arfuse_fp32_h2048_w16_oneshot_norm", "arfuse_fp32_h4096_w16_oneshot_norm"}},
		{"explicit generic list", `
groups:
  - hidden: [2048]
    dtypes: [bf16]
    world_sizes: [2]
    algorithms: [oneshot]
    outputs: [norm]
generic:
  - dtypes: [fp32]
    algorithms: [oneshot, twoshot]
    outputs: [norm]
`, []string{"arfuse_bf16_h2048_w2_oneshot_norm", "arfuse_fp32_generic_oneshot_norm", "arfuse_fp32_generic_twoshot_norm"}},
	}
	for _, c := range cases {
		vs, err := expandText(t, c.text)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if got := strings.Join(names(vs), " "); got != strings.Join(c.want, " ") {
			t.Errorf("%s:\n got %s\nwant %s", c.name, got, strings.Join(c.want, " "))
		}
	}
}

func TestMatrixModelsRecorded(t *testing.T) {
	vs, err := expandText(t, `
groups:
  - models: [deepseek-v3, deepseek-r1]
    dtypes: [bf16]
    world_sizes: [8]
    algorithms: [oneshot]
    outputs: [norm]
`)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(vs[0].Models, ","); got != "deepseek-r1,deepseek-v3" {
		t.Errorf("models %q", got)
	}
}

// Each rule of the matrix, with the exact message after the file name. The golden cases under
// testdata/ cover the same rules end to end through run().
func TestMatrixRejects(t *testing.T) {
	const tail = `
    world_sizes: [8]
    algorithms: [oneshot]
    outputs: [norm]
`
	cases := []struct{ text, want string }{
		{"", `:1: groups: empty matrix: the file has no groups`},
		{"# only a comment\n", `:1: groups: empty matrix: the file has no groups`},
		{"groups: []\n", `:1: groups: empty matrix: no groups`},
		{"- a\n", `:1: want a mapping at the top level, got a list`},
		{"groups: [\n", `:1: malformed YAML: did not find expected node content`},
		{"groups:\n  - hidden: [8]\n    hidden: [16]\n", `:3: groups[0].hidden: key given twice`},
		{"groups: []\n---\ngroups: []\n", `:2: malformed YAML: more than one document`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]" + tail + "extra: 1\n", `:7: extra: unknown key (want one of groups, generic)`},
		{"groups:\n  - hidden: [2048]\n    dtype: [bf16]" + tail, `:3: groups[0].dtype: unknown key (want one of models, hidden, dtypes, world_sizes, algorithms, outputs)`},
		{"groups:\n  - hidden: [2048]" + tail, `:2: groups[0].dtypes: required key missing`},
		{"groups:\n  - hidden: [2048]\n    dtypes: bf16" + tail, `:3: groups[0].dtypes: "bf16": want a list, got a string`},
		{"groups:\n  - hidden: [2048]\n    dtypes: []" + tail, `:3: groups[0].dtypes: empty list: the group would produce no variants`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16, bf16]" + tail, `:3: groups[0].dtypes[1]: "bf16": listed twice`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf8]" + tail, `:3: groups[0].dtypes[0]: "bf8": unknown dtype (want one of bf16, fp16, fp32)`},
		{"groups:\n  - hidden: [2048.0]\n    dtypes: [bf16]" + tail, `:2: groups[0].hidden[0]: 2048.0: want an integer, got a number`},
		{"groups:\n  - hidden: []\n    dtypes: [bf16]" + tail, `:2: groups[0]: empty group: no hidden sizes (give models, hidden or both)`},
		{"groups:\n  - hidden: [2052]\n    dtypes: [bf16]" + tail, `:2: groups[0].hidden[0]: 2052: hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)`},
		{"groups:\n  - hidden: [8196]\n    dtypes: [fp32]" + tail, `:2: groups[0].hidden[0]: 8196: fp32 row needs 9 vectors per thread (max 8): it would not stay in registers`},
		{"groups:\n  - models: [deepseek-v4]\n    dtypes: [bf16]" + tail, `:2: groups[0].models[0]: "deepseek-v4": unknown model (want one of deepseek-r1, deepseek-v3, gpt-oss-120b, qwen3-235b-a22b, qwen3-30b-a3b)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [3]\n    algorithms: [oneshot]\n    outputs: [norm]\n", `:4: groups[0].world_sizes[0]: 3: unsupported world size (want one of 1, 2, 4, 8, 16)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [8]\n    algorithms: [threeshot]\n    outputs: [norm]\n", `:5: groups[0].algorithms[0]: "threeshot": unknown algorithm (want one of oneshot, twoshot, local)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [8]\n    algorithms: [oneshot]\n    outputs: [fp8]\n", `:6: groups[0].outputs[0]: "fp8": unknown output kind (want one of norm, fp8_static, fp8_token, fp8_group128)`},
		{"groups:\n  - models: [gpt-oss-120b]\n    dtypes: [bf16]\n    world_sizes: [8]\n    algorithms: [oneshot]\n    outputs: [norm, fp8_group128]\n",
			`:2: groups[0].models[0]: "gpt-oss-120b": hidden 2880 of this model: fp8_group128 needs a hidden size that is a multiple of 128 (one FP8 scale per group of 128 elements)`},
		// 2176 = 17 * 128: the one-shot plan splits the bf16 row over 2 CTAs of 136 vectors, which
		// cuts a group of 16 vectors in two.
		{"groups:\n  - hidden: [2048, 2176]\n    dtypes: [bf16]\n    world_sizes: [8]\n    algorithms: [twoshot, oneshot]\n    outputs: [fp8_group128]\n",
			`:2: groups[0].hidden[1]: 2176: fp8_group128: the bf16 oneshot plan gives each CTA 136 vectors and 160 threads per token, not whole groups of 16 vectors (128 elements)`},
		// World size 1 is the local algorithm's alone, and local serves world size 1 alone.
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [2, 1]\n    algorithms: [oneshot]\n    outputs: [norm]\n",
			`:4: groups[0].world_sizes[1]: 1: world size 1 has no all-reduce: it is served by algorithm local, not oneshot (give world size 1 a group of its own)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [1, 4]\n    algorithms: [local]\n    outputs: [norm]\n",
			`:4: groups[0].world_sizes[1]: 4: algorithm local is the world-size-1 op (no all-reduce): world size 4 needs an all-reduce algorithm (oneshot or twoshot) (give world size 1 a group of its own)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]\n    world_sizes: [1]\n    algorithms: [local, twoshot]\n    outputs: [norm]\n",
			`:4: groups[0].world_sizes[0]: 1: world size 1 has no all-reduce: it is served by algorithm local, not twoshot (give world size 1 a group of its own)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]" + tail + "generic: yes please\n", `:7: generic: "yes please": want true, false or a list of {dtypes, algorithms, outputs}, got a string`},
		{"groups:\n  - models: [qwen3-30b-a3b]\n    dtypes: [bf16]" + tail + "  - hidden: [2048, 4096]\n    dtypes: [bf16]" + tail,
			`:7: groups[1]: "arfuse_bf16_h2048_w8_oneshot_norm": duplicate variant (groups[0] at line 2 produces it too)`},
		{"groups:\n  - hidden: [2048]\n    dtypes: [bf16]" + tail + "generic:\n  - dtypes: [bf16]\n    algorithms: [oneshot]\n    outputs: [norm]\n  - dtypes: [bf16]\n    algorithms: [oneshot]\n    outputs: [norm]\n",
			`:11: generic[1]: "arfuse_bf16_generic_oneshot_norm": duplicate variant (generic[0] at line 8 produces it too)`},
	}
	for _, c := range cases {
		_, err := expandText(t, c.text)
		if got := stripFile(err); got != c.want {
			t.Errorf("matrix %q:\n got %s\nwant %s", c.text, got, c.want)
		}
	}
}

func TestTuning(t *testing.T) {
	dir := t.TempDir()
	ok := `card: NVIDIA H200
date: 2025-01-31
commit: 0123abc
command: python -m arfuse.bench --sweep
thresholds:
  - {dtype: fp16, hidden: 4096, world_size: 4, oneshot_max_tokens: 64}
  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 128}
`
	tu, err := loadTuning(writeTemp(t, dir, "t.yaml", ok))
	if err != nil {
		t.Fatal(err)
	}
	if tu.Date != "2025-01-31" || len(tu.Rows) != 2 || tu.Rows[1].OneshotMaxTokens != 128 {
		t.Errorf("parsed %+v", tu)
	}
	g := newGen("m.yaml", nil, nil, tu)
	if g.Tuning.Rows[0].DType.Name != "bf16" || tu.Rows[0].DType.Name != "fp16" {
		t.Errorf("rows not sorted in a copy: %+v", g.Tuning.Rows)
	}
	// card_thresholds: rows of other cards, sorted in the copy too, provenance their own.
	cardsOK := ok + `card_thresholds:
  - card: NVIDIA H100 80GB HBM3
    date: 2025-02-01
    commit: 89abcde
    command: python -m arfuse.bench --tune
    thresholds:
      - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 16}
      - {dtype: bf16, hidden: 4096, world_size: 2, oneshot_max_tokens: 64}
`
	tc, err := loadTuning(writeTemp(t, dir, "t.yaml", cardsOK))
	if err == nil {
		err = checkTuning(tc)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(tc.Cards) != 1 || tc.Cards[0].Card != "NVIDIA H100 80GB HBM3" || tc.Cards[0].Commit != "89abcde" ||
		len(tc.Cards[0].Rows) != 2 || tc.Cards[0].Rows[0].OneshotMaxTokens != 16 || len(tc.Rows) != 2 {
		t.Errorf("parsed card_thresholds %+v", tc.Cards)
	}
	if g := newGen("m.yaml", nil, nil, tc); g.Tuning.Cards[0].Rows[0].Hidden != 4096 || tc.Cards[0].Rows[0].Hidden != 7168 {
		t.Errorf("card rows not sorted in a copy: %+v", g.Tuning.Cards)
	}
	head := "card: c\ndate: \"2025-01-31\"\ncommit: 0123456\ncommand: bench\n"
	card := func(name string) string {
		return "thresholds: []\ncard_thresholds:\n  - card: " + name + "\n    date: \"2025-02-01\"\n    commit: 89abcde\n    command: x\n    thresholds:\n"
	}
	row := "      - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 16}\n"
	split := "thresholds: []\nmin_blocks_splits:\n  card: c\n  date: \"2025-01-31\"\n  commit: 0123456\n  command: x\n  rows:\n"
	buffered := "thresholds: []\nbuffered_splits:\n  card: c\n  date: \"2025-01-31\"\n  commit: 0123456\n  command: x\n  rows:\n"
	cases := []struct{ text, want string }{
		{"card: \"\"\ndate: \"\"\ncommit: \"\"\ncommand: \"\"\nthresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 1}\n",
			`:1: card: "": required once thresholds has rows (say where they were measured)`},
		{head + "thresholds: []\nextra: 1\n", `:6: extra: unknown key (want one of card, date, commit, command, thresholds, card_thresholds, min_blocks_splits, buffered_splits)`},
		{"card: c\ndate: \"2025\"\ncommit: 0123456\ncommand: bench\nthresholds: []\n", `:2: date: "2025": want YYYY-MM-DD`},
		{"card: c\ndate: 2025-01-31\ncommit: main\ncommand: bench\nthresholds: []\n", `:3: commit: "main": want a git commit hash (7 to 40 lower-case hex digits)`},
		{"card: [c]\ndate: 2025-01-31\ncommit: 0123456\ncommand: bench\nthresholds: []\n", `:1: card: want a string, got a list`},
		{"card: \"a\\nb\"\ndate: \"\"\ncommit: \"\"\ncommand: \"\"\nthresholds: []\n", `:1: card: "a\nb": want one line of printable text, not ending in a backslash`},
		{head + "thresholds:\n  - {dtype: bf8, hidden: 7168, world_size: 8, oneshot_max_tokens: 1}\n", `:6: thresholds[0].dtype: "bf8": unknown dtype (want one of bf16, fp16, fp32)`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 0}\n", `:6: thresholds[0].oneshot_max_tokens: 0: threshold must be positive`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: -4}\n", `:6: thresholds[0].oneshot_max_tokens: -4: threshold must be positive`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7170, world_size: 8, oneshot_max_tokens: 4}\n", `:6: thresholds[0].hidden: 7170: hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 6, oneshot_max_tokens: 4}\n", `:6: thresholds[0].world_size: 6: unsupported world size (want one of 1, 2, 4, 8, 16)`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 2048, world_size: 1, oneshot_max_tokens: 4}\n", `:6: thresholds[0].world_size: 1: world size 1 runs algorithm local only: there is no one-shot/two-shot threshold to tune`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 8}\n", `:6: thresholds[0].oneshot_max_tokens: required key missing`},
		{head + "thresholds:\n  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 4}\n  - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 8}\n",
			`:7: thresholds[1]: duplicate row: thresholds[0] has the same dtype, hidden and world_size`},
		// The token splits (min_blocks_splits): their own provenance, then rows the plan checks.
		{head + "thresholds: []\nmin_blocks_splits:\n  card: c\n  date: \"2025-01-31\"\n  commit: 0123456\n  rows: []\n", `:7: min_blocks_splits.command: required key missing`},
		{head + "thresholds: []\nmin_blocks_splits:\n  card: \"\"\n  date: \"2025-01-31\"\n  commit: 0123456\n  command: x\n  rows: []\n", `:7: min_blocks_splits.card: "": required (say where the rows were measured)`},
		{head + "thresholds: []\nmin_blocks_splits:\n  card: c\n  date: \"2025-01\"\n  commit: 0123456\n  command: x\n  rows: []\n", `:8: min_blocks_splits.date: "2025-01": want YYYY-MM-DD`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: threeshot, out: norm, unbound_max_tokens: 256}\n", `:12: min_blocks_splits.rows[0].algorithm: "threeshot": unknown algorithm (want one of oneshot, twoshot, local)`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: fp4, unbound_max_tokens: 256}\n", `:12: min_blocks_splits.rows[0].out: "fp4": unknown output kind (want one of norm, fp8_static, fp8_token, fp8_group128)`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm, unbound_max_tokens: 0}\n", `:12: min_blocks_splits.rows[0].unbound_max_tokens: 0: token count must be positive`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm}\n", `:12: min_blocks_splits.rows[0].unbound_max_tokens: required key missing`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm, unbound_max_tokens: 256}\n    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm, unbound_max_tokens: 64}\n",
			`:13: min_blocks_splits.rows[1]: duplicate row: rows[0] has the same dtype, hidden, world_size, algorithm and out`},
		{head + split + "    - {dtype: bf16, hidden: 4096, world_size: 1, algorithm: twoshot, out: norm, unbound_max_tokens: 256}\n", `:12: min_blocks_splits.rows[0].world_size: 1: world size 1 has no all-reduce: it is served by algorithm local, not twoshot`},
		{head + split + "    - {dtype: bf16, hidden: 4100, world_size: 2, algorithm: twoshot, out: norm, unbound_max_tokens: 256}\n", `:12: min_blocks_splits.rows[0].hidden: 4100: hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)`},
		{head + split + "    - {dtype: bf16, hidden: 2880, world_size: 2, algorithm: twoshot, out: fp8_group128, unbound_max_tokens: 256}\n", `:12: min_blocks_splits.rows[0].hidden: 2880: fp8_group128 needs a hidden size that is a multiple of 128 (one FP8 scale per group of 128 elements)`},
		{head + split + "    - {dtype: bf16, hidden: 7168, world_size: 8, algorithm: oneshot, out: norm, unbound_max_tokens: 16}\n",
			`:12: min_blocks_splits.rows[0]: the plan of arfuse_bf16_h7168_w8_oneshot_norm asks for no blocks-per-SM bound: there is no unbound twin to build (plan.go: twoShotMinBlocks, minBlocksAbove)`},
		// The buffered splits (buffered_splits): two-shot only, below any unbound twin's range.
		{head + buffered + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm, unbound_max_tokens: 64}\n",
			`:12: buffered_splits.rows[0].unbound_max_tokens: unknown key (want one of dtype, hidden, world_size, algorithm, out, buffered_max_tokens)`},
		{head + buffered + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: twoshot, out: norm, buffered_max_tokens: -1}\n",
			`:12: buffered_splits.rows[0].buffered_max_tokens: -1: token count must be positive`},
		{head + buffered + "    - {dtype: bf16, hidden: 4096, world_size: 2, algorithm: oneshot, out: norm, buffered_max_tokens: 64}\n",
			`:12: buffered_splits.rows[0]: algorithm oneshot has no owner: a buffered twin is two-shot's (the owner's own tokens through its own buffer)`},
		{head + buffered + "    - {dtype: bf16, hidden: 4100, world_size: 2, algorithm: twoshot, out: norm, buffered_max_tokens: 64}\n",
			`:12: buffered_splits.rows[0].hidden: 4100: hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)`},
		{head + "thresholds: []\nmin_blocks_splits:\n  card: c\n  date: \"2025-01-31\"\n  commit: 0123456\n  command: x\n  rows:\n" +
			"    - {dtype: bf16, hidden: 4096, world_size: 8, algorithm: twoshot, out: norm, unbound_max_tokens: 32}\n" +
			"buffered_splits:\n  card: c\n  date: \"2025-01-31\"\n  commit: 0123456\n  command: x\n  rows:\n" +
			"    - {dtype: bf16, hidden: 4096, world_size: 8, algorithm: twoshot, out: norm, buffered_max_tokens: 64}\n",
			`:19: buffered_splits.rows[0]: buffered_max_tokens 64 is above the unbound twin's 32 (min_blocks_splits): the buffered twin must serve the lowest token counts`},
		// card_thresholds sections: provenance, a device name that can be matched, rows.
		{head + card("c") + row, `:7: card_thresholds[0].card: "c": is the card of the default table: its rows go in thresholds`},
		{head + card("h100") + row + "  - card: h100\n    date: \"2025-02-01\"\n    commit: 89abcde\n    command: x\n    thresholds:\n" + row,
			`:13: card_thresholds[1].card: "h100": duplicate card: card_thresholds[0] names it too`},
		{head + card(`'say "h100"'`) + row, `:7: card_thresholds[0].card: "say \"h100\"": want the device name as CUDA reports it (nvidia-smi --query-gpu=name): no quotes, backslashes or surrounding spaces`},
		{head + card(`"h100 "`) + row, `:7: card_thresholds[0].card: "h100 ": want the device name as CUDA reports it (nvidia-smi --query-gpu=name): no quotes, backslashes or surrounding spaces`},
		{head + card(`""`) + row, `:7: card_thresholds[0].card: "": required (say where the rows were measured)`},
		{head + card("h100") + "      []\n", `:12: card_thresholds[0].thresholds: want at least one row (a card without rows uses the default table)`},
		{head + "thresholds: []\ncard_thresholds:\n  - card: h100\n    date: \"2025-02-01\"\n    commit: 89abcde\n    thresholds: []\n", `:7: card_thresholds[0].command: required key missing`},
		{head + "thresholds: []\ncard_thresholds:\n  - card: h100\n    date: \"2025-02\"\n    commit: 89abcde\n    command: x\n    thresholds:\n" + row, `:8: card_thresholds[0].date: "2025-02": want YYYY-MM-DD`},
		{head + card("h100") + row + "      - {dtype: bf16, hidden: 7168, world_size: 8, oneshot_max_tokens: 32}\n",
			`:13: card_thresholds[0].thresholds[1]: duplicate row: card_thresholds[0].thresholds[0] has the same dtype, hidden and world_size`},
		{head + card("h100") + "      - {dtype: bf16, hidden: 7170, world_size: 8, oneshot_max_tokens: 16}\n",
			`:12: card_thresholds[0].thresholds[0].hidden: 7170: hidden size not a multiple of the bf16 vector width 8 (16-byte vectors)`},
		{head + card("h100") + "      - {dtype: bf16, hidden: 2048, world_size: 1, oneshot_max_tokens: 4}\n",
			`:12: card_thresholds[0].thresholds[0].world_size: 1: world size 1 runs algorithm local only: there is no one-shot/two-shot threshold to tune`},
		{head + "thresholds: []\ncard_thresholds: {card: h100}\n", `:6: card_thresholds: want a list, got a mapping`},
	}
	for _, c := range cases {
		// Parsed by the model, the hidden size checked by the plan.
		tu, err := loadTuning(writeTemp(t, dir, "t.yaml", c.text))
		if err == nil {
			err = checkTuning(tu)
		}
		if got := stripFile(err); got != c.want {
			t.Errorf("tuning %q:\n got %s\nwant %s", c.text, got, c.want)
		}
	}
}

func TestModels(t *testing.T) {
	dir := t.TempDir()
	row := func(name, hf string, hidden, topk, experts int) string {
		return "  - {name: " + name + ", hf_id: " + hf + ", hidden: " + strconv.Itoa(hidden) + ", top_k: " + strconv.Itoa(topk) + ", experts: " + strconv.Itoa(experts) + "}\n"
	}
	cases := []struct{ text, want string }{
		{"models:\n" + row("DeepSeek-V3", "deepseek-ai/DeepSeek-V3", 7168, 8, 256), `:2: models[0].name: "DeepSeek-V3": want a lower-case dashed name such as deepseek-v3`},
		{"models:\n" + row("a", "x/y", 7168, 8, 256) + row("a", "x/y", 7168, 8, 256), `:3: models[1].name: "a": model listed twice`},
		{"models:\n" + row("a", "nohf", 7168, 8, 256), `:2: models[0].hf_id: "nohf": want a Hugging Face id such as deepseek-ai/DeepSeek-V3`},
		{"models:\n" + row("a", "x/y", 7168, 65, 256), `:2: models[0].top_k: 65: want 1 to 64 (arfuse::kMaxTopK)`},
		{"models:\n" + row("a", "x/y", 7168, 8, 4), `:2: models[0].experts: 4: fewer experts than top_k 8`},
		{"models:\n" + row("a", "x/y", 0, 8, 8), `:2: models[0].hidden: 0: want 1 to 65536`},
		{"models: []\n", `:1: models: empty list: no models`},
	}
	for _, c := range cases {
		_, err := loadModels(writeTemp(t, dir, "m.yaml", c.text))
		if got := stripFile(err); got != c.want {
			t.Errorf("models %q:\n got %s\nwant %s", c.text, got, c.want)
		}
	}
}

// The model parses and records where; the plan decides. No identifier declared in plan.go is
// used in model.go (an arrow from the model back up into the plan is what this forbids).
func TestModelDoesNotReachIntoPlan(t *testing.T) {
	fset := token.NewFileSet()
	plan, err := parser.ParseFile(fset, "plan.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	declared := map[string]bool{}
	for _, d := range plan.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				declared[d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.TypeSpec:
					declared[s.Name.Name] = true
				case *ast.ValueSpec:
					for _, n := range s.Names {
						declared[n.Name] = true
					}
				}
			}
		}
	}
	if !declared["planSpecialised"] || !declared["hiddenRule"] || !declared["Plan"] {
		t.Fatalf("plan.go declarations not found: %v", declared)
	}
	model, err := parser.ParseFile(fset, "model.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	skip := map[*ast.Ident]bool{} // field names: x.Name and Name: in a composite literal
	ast.Inspect(model, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			skip[n.Sel] = true
		case *ast.KeyValueExpr:
			if id, ok := n.Key.(*ast.Ident); ok {
				skip[id] = true
			}
		case *ast.Ident:
			// Obj != nil: declared in model.go itself (a local, or a package-level name there).
			if !skip[n] && n.Obj == nil && declared[n.Name] {
				t.Errorf("%s: model.go uses %s, declared in plan.go", fset.Position(n.Pos()), n.Name)
			}
		}
		return true
	})
}

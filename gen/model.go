package main

// The model: the three input files (models, matrix, tuning) read strictly, every name resolved
// against the tables (tables.go) and every value kept with the place it came from (Where). The
// model only parses: whether a hidden size can be built (range, vector width, registers,
// quantization groups) is the plan's rule (plan.go), reported at the Where the model recorded.
// Nothing in this file refers to plan.go.

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"unicode"

	"gopkg.in/yaml.v3"
)

// Model is one MoE model of variants/models.yaml. Python reads the same file (name, hidden,
// top_k, experts), so those key names are part of its contract.
type Model struct {
	Name    string
	HFID    string
	Hidden  int
	TopK    int
	Experts int
}

var modelNameRE = regexp.MustCompile(`^[a-z0-9]+([.-][a-z0-9]+)*$`)
var hfIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$`)

// loadModels reads variants/models.yaml.
func loadModels(path string) ([]*Model, error) {
	d, root, err := load(path)
	if err != nil {
		return nil, err
	}
	if root == nil {
		return nil, &InputError{File: path, Line: 1, Path: "models", Rule: "required key missing"}
	}
	top, err := d.fields(root, "", []string{"models"}, []string{"models"})
	if err != nil {
		return nil, err
	}
	items, err := d.seq(top["models"], "models")
	if err != nil {
		return nil, err
	}
	if len(items) == 0 {
		return nil, d.errNoValue(top["models"], "models", "empty list: no models")
	}
	var models []*Model
	for i, it := range items {
		p := index("models", i)
		f, err := d.fields(it, p, []string{"name", "hf_id", "hidden", "top_k", "experts"},
			[]string{"name", "hf_id", "hidden", "top_k", "experts"})
		if err != nil {
			return nil, err
		}
		m := &Model{}
		if m.Name, err = d.str(f["name"], join(p, "name")); err != nil {
			return nil, err
		}
		if !modelNameRE.MatchString(m.Name) {
			return nil, d.errAt(f["name"], join(p, "name"), "want a lower-case dashed name such as deepseek-v3")
		}
		for _, o := range models {
			if o.Name == m.Name {
				return nil, d.errAt(f["name"], join(p, "name"), "model listed twice")
			}
		}
		if m.HFID, err = d.str(f["hf_id"], join(p, "hf_id")); err != nil {
			return nil, err
		}
		if !hfIDRE.MatchString(m.HFID) {
			return nil, d.errAt(f["hf_id"], join(p, "hf_id"), "want a Hugging Face id such as deepseek-ai/DeepSeek-V3")
		}
		if m.Hidden, err = d.integer(f["hidden"], join(p, "hidden")); err != nil {
			return nil, err
		}
		if m.Hidden <= 0 || m.Hidden > maxHidden {
			return nil, d.errAt(f["hidden"], join(p, "hidden"), "want 1 to %d", maxHidden)
		}
		if m.TopK, err = d.integer(f["top_k"], join(p, "top_k")); err != nil {
			return nil, err
		}
		if m.TopK < 1 || m.TopK > maxTopK {
			return nil, d.errAt(f["top_k"], join(p, "top_k"), "want 1 to %d (arfuse::kMaxTopK)", maxTopK)
		}
		if m.Experts, err = d.integer(f["experts"], join(p, "experts")); err != nil {
			return nil, err
		}
		if m.Experts < m.TopK {
			return nil, d.errAt(f["experts"], join(p, "experts"), "fewer experts than top_k %d", m.TopK)
		}
		models = append(models, m)
	}
	return models, nil
}

// Matrix is one variants/*.yaml file.
type Matrix struct {
	File    string
	Groups  []*Group
	Generic GenericSpec
}

// Group is one cross product of the matrix.
type Group struct {
	Path    string // groups[1]
	Line    int
	Hiddens []HiddenEntry
	DTypes  []*DType
	Worlds  []int
	// WorldsAt: where each of Worlds was written (the plan reports a world size no algorithm of
	// the group serves there).
	WorldsAt []Where
	Algos    []*Algo
	Outs     []*OutKind
}

// HiddenEntry is one hidden size of a group and where it came from (a model or a raw size), kept
// so that a size the plan rejects is reported at the entry that asked for it.
type HiddenEntry struct {
	Hidden int
	Model  string // "" for a raw size
	At     Where
}

// Where is the place of one value in an input file: what a rule checked after parsing (by the
// plan) needs to report the entry that asked for it.
type Where struct {
	File  string
	Line  int
	Path  string // groups[0].hidden[1]
	Value string // as written, strings quoted
}

// Errorf is an InputError at w.
func (w Where) Errorf(rule string, args ...any) *InputError {
	return &InputError{File: w.File, Line: w.Line, Path: w.Path, Value: w.Value, Rule: fmt.Sprintf(rule, args...)}
}

// where records the place of the scalar n.
func (d *doc) where(n *yaml.Node, path string) Where {
	n = resolve(n)
	return Where{File: d.file, Line: n.Line, Path: path, Value: scalarText(n)}
}

// GenericSpec says which generic instances to emit: Auto derives them from the groups; Groups
// lists them explicitly.
type GenericSpec struct {
	Auto   bool
	Line   int
	Groups []*GenericGroup
}

// GenericGroup is one explicit cross product of generic instances.
type GenericGroup struct {
	Path   string
	Line   int
	DTypes []*DType
	Algos  []*Algo
	Outs   []*OutKind
}

var groupKeys = []string{"models", "hidden", "dtypes", "world_sizes", "algorithms", "outputs"}
var genericKeys = []string{"dtypes", "algorithms", "outputs"}

// loadMatrix reads a matrix file, resolving model names through models.
func loadMatrix(path string, models []*Model) (*Matrix, error) {
	d, root, err := load(path)
	if err != nil {
		return nil, err
	}
	if root == nil {
		return nil, &InputError{File: path, Line: 1, Path: "groups", Rule: "empty matrix: the file has no groups"}
	}
	top, err := d.fields(root, "", []string{"groups", "generic"}, []string{"groups"})
	if err != nil {
		return nil, err
	}
	m := &Matrix{File: path}
	items, err := d.seq(top["groups"], "groups")
	if err != nil {
		return nil, err
	}
	if len(items) == 0 {
		return nil, d.errNoValue(top["groups"], "groups", "empty matrix: no groups")
	}
	for i, it := range items {
		g, err := d.group(it, index("groups", i), models)
		if err != nil {
			return nil, err
		}
		m.Groups = append(m.Groups, g)
	}
	if gn, ok := top["generic"]; ok {
		gn = resolve(gn)
		m.Generic.Line = gn.Line
		if gn.Kind == yaml.SequenceNode {
			for i, it := range gn.Content {
				g, err := d.genericGroup(it, index("generic", i))
				if err != nil {
					return nil, err
				}
				m.Generic.Groups = append(m.Generic.Groups, g)
			}
		} else {
			b, err := d.boolean(gn, "generic")
			if err != nil {
				return nil, d.errAt(gn, "generic", "want true, false or a list of {dtypes, algorithms, outputs}, got %s", kindName(gn))
			}
			m.Generic.Auto = b
		}
	}
	return m, nil
}

func (d *doc) group(n *yaml.Node, path string, models []*Model) (*Group, error) {
	f, err := d.fields(n, path, groupKeys, []string{"dtypes", "world_sizes", "algorithms", "outputs"})
	if err != nil {
		return nil, err
	}
	g := &Group{Path: path, Line: resolve(n).Line}
	if mn, ok := f["models"]; ok {
		names, nodes, err := d.strList(mn, join(path, "models"))
		if err != nil {
			return nil, err
		}
		for i, name := range names {
			p := index(join(path, "models"), i)
			idx := slices.IndexFunc(models, func(m *Model) bool { return m.Name == name })
			if idx < 0 {
				return nil, d.errAt(resolve(nodes[i]), p, "unknown model (want one of %s)", strings.Join(modelNames(models), ", "))
			}
			g.Hiddens = append(g.Hiddens, HiddenEntry{Hidden: models[idx].Hidden, Model: name, At: d.where(nodes[i], p)})
		}
	}
	if hn, ok := f["hidden"]; ok {
		sizes, nodes, err := d.intList(hn, join(path, "hidden"))
		if err != nil {
			return nil, err
		}
		for i, h := range sizes {
			g.Hiddens = append(g.Hiddens, HiddenEntry{Hidden: h, At: d.where(nodes[i], index(join(path, "hidden"), i))})
		}
	}
	if len(g.Hiddens) == 0 {
		return nil, d.errNoValue(n, path, "empty group: no hidden sizes (give models, hidden or both)")
	}
	if g.DTypes, err = d.dtypeList(f["dtypes"], join(path, "dtypes")); err != nil {
		return nil, err
	}
	wp := join(path, "world_sizes")
	worlds, nodes, err := d.intList(f["world_sizes"], wp)
	if err != nil {
		return nil, err
	}
	if len(worlds) == 0 {
		return nil, d.errNoValue(f["world_sizes"], wp, "empty list: the group would produce no variants")
	}
	for i, w := range worlds {
		if !slices.Contains(worldSizes, w) {
			return nil, d.errAt(resolve(nodes[i]), index(wp, i), "unsupported world size (want one of %s)", intsText(worldSizes))
		}
	}
	g.Worlds = worlds
	for i := range worlds {
		g.WorldsAt = append(g.WorldsAt, d.where(nodes[i], index(wp, i)))
	}
	if g.Algos, err = d.algoList(f["algorithms"], join(path, "algorithms")); err != nil {
		return nil, err
	}
	if g.Outs, err = d.outList(f["outputs"], join(path, "outputs")); err != nil {
		return nil, err
	}
	return g, nil
}

func (d *doc) genericGroup(n *yaml.Node, path string) (*GenericGroup, error) {
	f, err := d.fields(n, path, genericKeys, genericKeys)
	if err != nil {
		return nil, err
	}
	g := &GenericGroup{Path: path, Line: resolve(n).Line}
	if g.DTypes, err = d.dtypeList(f["dtypes"], join(path, "dtypes")); err != nil {
		return nil, err
	}
	if g.Algos, err = d.algoList(f["algorithms"], join(path, "algorithms")); err != nil {
		return nil, err
	}
	if g.Outs, err = d.outList(f["outputs"], join(path, "outputs")); err != nil {
		return nil, err
	}
	return g, nil
}

// nameList reads a non-empty list of names, each of which must be in want.
func (d *doc) nameList(n *yaml.Node, path, what string, want []string) ([]string, error) {
	names, nodes, err := d.strList(n, path)
	if err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, d.errNoValue(n, path, "empty list: the group would produce no variants")
	}
	for i, s := range names {
		if !slices.Contains(want, s) {
			return nil, d.errAt(resolve(nodes[i]), index(path, i), "unknown %s (want one of %s)", what, strings.Join(want, ", "))
		}
	}
	return names, nil
}

// tableList reads a non-empty list of names of table entries (dtypes, algorithms, output kinds)
// and returns the entries.
func tableList[T interface{ name() string }](d *doc, n *yaml.Node, path, what string, table []T) ([]T, error) {
	names, err := d.nameList(n, path, what, namesOf(table))
	var out []T
	for _, s := range names {
		out = append(out, byName(table, s))
	}
	return out, err
}

func (d *doc) dtypeList(n *yaml.Node, path string) ([]*DType, error) {
	return tableList(d, n, path, "dtype", dtypes)
}

func (d *doc) algoList(n *yaml.Node, path string) ([]*Algo, error) {
	return tableList(d, n, path, "algorithm", algos)
}

func (d *doc) outList(n *yaml.Node, path string) ([]*OutKind, error) {
	return tableList(d, n, path, "output kind", outKinds)
}

func modelNames(models []*Model) []string {
	var s []string
	for _, m := range models {
		s = append(s, m.Name)
	}
	slices.Sort(s)
	return s
}

func intsText(v []int) string {
	var s []string
	for _, x := range v {
		s = append(s, fmt.Sprint(x))
	}
	return strings.Join(s, ", ")
}

// Tuning is variants/tuning.yaml: the measured one-shot/two-shot crossovers and where they were
// measured, the measured token splits of instances built for a blocks-per-SM bound, and those of
// two-shot instances whose mid-T twin goes through the owner's own buffer.
type Tuning struct {
	File     string
	Card     string
	Date     string
	Commit   string
	Command  string
	Rows     []Threshold
	Cards    []CardRows // card_thresholds: rows measured on other cards, served on those cards
	Splits   SplitTable // min_blocks_splits: MaxTokens is unbound_max_tokens
	Buffered SplitTable // buffered_splits: MaxTokens is buffered_max_tokens
}

// CardRows is one section of card_thresholds: one-shot/two-shot crossovers measured on one card
// (Card: the device name CUDA reports, e.g. "NVIDIA H100 80GB HBM3"), with their provenance. On a
// device of exactly that name the dispatch takes a combination's row from here first, then from
// the default table (Tuning.Rows), then the default rule (csrc/dispatch.cpp oneshot_max_tokens).
type CardRows struct {
	Provenance
	Rows []Threshold
}

// Provenance says where a table of measured rows was measured: card, date, commit, command.
type Provenance struct {
	Card, Date, Commit, Command string
}

// SplitTable is a token-split section of the tuning file (min_blocks_splits, buffered_splits): its
// own provenance (the measurement of the instance and its twin) and its rows.
type SplitTable struct {
	Provenance
	Rows []Split
}

// Split is one measured row: the specialised instance (DType, Hidden, World, Algo, Out) also gets
// a twin, and the dispatch runs the twin for T <= MaxTokens. min_blocks_splits: the twin is built
// without the plan's blocks-per-SM bound (ptxas's own register choice); buffered_splits: the
// two-shot twin sends the owner's own tokens through its own buffer (gen/plan.go splitByTokens).
type Split struct {
	RowAxes
	Algo      *Algo
	Out       *OutKind
	MaxTokens int
	At        Where // the row
}

// RowAxes are the dtype, hidden size and world size every measured row names.
type RowAxes struct {
	DType    *DType
	Hidden   int
	World    int
	HiddenAt Where // where Hidden was written (the plan checks it)
	WorldAt  Where // where World was written (the plan checks it)
}

// Threshold is one measured row: one-shot for T <= OneshotMaxTokens.
type Threshold struct {
	RowAxes
	OneshotMaxTokens int
}

var dateRE = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}$`)
var commitRE = regexp.MustCompile(`^[0-9a-f]{7,40}$`)

// loadTuning reads the tuning file. Its header says where the rows were measured and must be
// filled in as soon as there is a row.
func loadTuning(path string) (*Tuning, error) {
	d, root, err := load(path)
	if err != nil {
		return nil, err
	}
	if root == nil {
		return nil, &InputError{File: path, Line: 1, Path: "thresholds", Rule: "required key missing"}
	}
	header := []string{"card", "date", "commit", "command"}
	keys := append(slices.Clone(header), "thresholds")
	top, err := d.fields(root, "", append(slices.Clone(keys), "card_thresholds", "min_blocks_splits", "buffered_splits"), keys)
	if err != nil {
		return nil, err
	}
	t := &Tuning{File: path}
	vals := map[string]*string{"card": &t.Card, "date": &t.Date, "commit": &t.Commit, "command": &t.Command}
	for _, k := range header {
		if *vals[k], err = d.tuningText(top[k], k); err != nil {
			return nil, err
		}
	}
	items, err := d.seq(top["thresholds"], "thresholds")
	if err != nil {
		return nil, err
	}
	if len(items) > 0 {
		for _, k := range header {
			if *vals[k] == "" {
				return nil, d.errAt(resolve(top[k]), k, "required once thresholds has rows (say where they were measured)")
			}
		}
	}
	if t.Date != "" && !dateRE.MatchString(t.Date) {
		return nil, d.errAt(resolve(top["date"]), "date", "want YYYY-MM-DD")
	}
	if t.Commit != "" && !commitRE.MatchString(t.Commit) {
		return nil, d.errAt(resolve(top["commit"]), "commit", "want a git commit hash (7 to 40 lower-case hex digits)")
	}
	if t.Rows, err = d.thresholdRows(items, "thresholds"); err != nil {
		return nil, err
	}
	if n, ok := top["card_thresholds"]; ok {
		if t.Cards, err = d.cardSections(n, t.Card); err != nil {
			return nil, err
		}
	}
	if n, ok := top["min_blocks_splits"]; ok {
		if t.Splits, err = d.splitTable(n, "min_blocks_splits", "unbound_max_tokens"); err != nil {
			return nil, err
		}
	}
	if n, ok := top["buffered_splits"]; ok {
		if t.Buffered, err = d.splitTable(n, "buffered_splits", "buffered_max_tokens"); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// thresholdRows reads the one-shot/two-shot rows of a thresholds list (path: its key).
func (d *doc) thresholdRows(items []*yaml.Node, path string) ([]Threshold, error) {
	var rows []Threshold
	rowKeys := []string{"dtype", "hidden", "world_size", "oneshot_max_tokens"}
	for i, it := range items {
		p := index(path, i)
		f, err := d.fields(it, p, rowKeys, rowKeys)
		if err != nil {
			return nil, err
		}
		var r Threshold
		if r.RowAxes, err = d.rowAxes(f, p); err != nil {
			return nil, err
		}
		if r.OneshotMaxTokens, err = d.integer(f["oneshot_max_tokens"], join(p, "oneshot_max_tokens")); err != nil {
			return nil, err
		}
		if r.OneshotMaxTokens <= 0 {
			return nil, d.errAt(resolve(f["oneshot_max_tokens"]), join(p, "oneshot_max_tokens"), "threshold must be positive")
		}
		for j, o := range rows {
			if o.DType == r.DType && o.Hidden == r.Hidden && o.World == r.World {
				return nil, d.errNoValue(resolve(it), p, "duplicate row: %s has the same dtype, hidden and world_size", index(path, j))
			}
		}
		rows = append(rows, r)
	}
	return rows, nil
}

// cardSections reads card_thresholds: a list of sections, each the rows measured on one card with
// their provenance (card, date, commit, command, all required) and at least one row. A section's
// card is matched exactly against the run-time device name (printed into a C++ string literal),
// so it is one printable line without quotes or backslashes, and it is neither the default
// table's card (those rows are the default table) nor the card of another section.
func (d *doc) cardSections(n *yaml.Node, defaultCard string) ([]CardRows, error) {
	items, err := d.seq(n, "card_thresholds")
	if err != nil {
		return nil, err
	}
	var cards []CardRows
	header := []string{"card", "date", "commit", "command"}
	keys := append(slices.Clone(header), "thresholds")
	for i, it := range items {
		p := index("card_thresholds", i)
		f, err := d.fields(it, p, keys, keys)
		if err != nil {
			return nil, err
		}
		var c CardRows
		if c.Provenance, err = d.provenance(f, p); err != nil {
			return nil, err
		}
		cardAt := resolve(f["card"])
		if strings.ContainsAny(c.Card, "\"\\") || strings.TrimSpace(c.Card) != c.Card {
			return nil, d.errAt(cardAt, join(p, "card"), "want the device name as CUDA reports it (nvidia-smi --query-gpu=name): no quotes, backslashes or surrounding spaces")
		}
		if c.Card == defaultCard {
			return nil, d.errAt(cardAt, join(p, "card"), "is the card of the default table: its rows go in thresholds")
		}
		for j, o := range cards {
			if o.Card == c.Card {
				return nil, d.errAt(cardAt, join(p, "card"), "duplicate card: %s names it too", index("card_thresholds", j))
			}
		}
		rows, err := d.seq(f["thresholds"], join(p, "thresholds"))
		if err != nil {
			return nil, err
		}
		if len(rows) == 0 {
			return nil, d.errAt(resolve(f["thresholds"]), join(p, "thresholds"), "want at least one row (a card without rows uses the default table)")
		}
		if c.Rows, err = d.thresholdRows(rows, join(p, "thresholds")); err != nil {
			return nil, err
		}
		cards = append(cards, c)
	}
	return cards, nil
}

// provenance reads the card, date, commit and command of a section of measured rows (path: the
// section), all required: the rows are measurements and say where they were made.
func (d *doc) provenance(f map[string]*yaml.Node, path string) (Provenance, error) {
	var pv Provenance
	vals := map[string]*string{"card": &pv.Card, "date": &pv.Date, "commit": &pv.Commit, "command": &pv.Command}
	for _, k := range []string{"card", "date", "commit", "command"} {
		v, err := d.tuningText(f[k], join(path, k))
		if err != nil {
			return pv, err
		}
		if v == "" {
			return pv, d.errAt(resolve(f[k]), join(path, k), "required (say where the rows were measured)")
		}
		*vals[k] = v
	}
	if !dateRE.MatchString(pv.Date) {
		return pv, d.errAt(resolve(f["date"]), join(path, "date"), "want YYYY-MM-DD")
	}
	if !commitRE.MatchString(pv.Commit) {
		return pv, d.errAt(resolve(f["commit"]), join(path, "commit"), "want a git commit hash (7 to 40 lower-case hex digits)")
	}
	return pv, nil
}

// splitTable reads a token-split section (path: its key) whose rows give the twin's largest T
// in the field tokensKey: a provenance header (required, as the rows are measured) and its rows.
func (d *doc) splitTable(n *yaml.Node, path, tokensKey string) (SplitTable, error) {
	var t SplitTable
	header := []string{"card", "date", "commit", "command"}
	keys := append(slices.Clone(header), "rows")
	f, err := d.fields(n, path, keys, keys)
	if err != nil {
		return t, err
	}
	if t.Provenance, err = d.provenance(f, path); err != nil {
		return t, err
	}
	items, err := d.seq(f["rows"], join(path, "rows"))
	if err != nil {
		return t, err
	}
	rowKeys := []string{"dtype", "hidden", "world_size", "algorithm", "out", tokensKey}
	for i, it := range items {
		p := index(join(path, "rows"), i)
		rf, err := d.fields(it, p, rowKeys, rowKeys)
		if err != nil {
			return t, err
		}
		r := Split{At: d.where(it, p)}
		if r.RowAxes, err = d.rowAxes(rf, p); err != nil {
			return t, err
		}
		name, err := d.str(rf["algorithm"], join(p, "algorithm"))
		if err != nil {
			return t, err
		}
		if r.Algo = algoByName(name); r.Algo == nil {
			return t, d.errAt(resolve(rf["algorithm"]), join(p, "algorithm"), "unknown algorithm (want one of %s)", strings.Join(namesOf(algos), ", "))
		}
		if name, err = d.str(rf["out"], join(p, "out")); err != nil {
			return t, err
		}
		if r.Out = outKindByName(name); r.Out == nil {
			return t, d.errAt(resolve(rf["out"]), join(p, "out"), "unknown output kind (want one of %s)", strings.Join(namesOf(outKinds), ", "))
		}
		if r.MaxTokens, err = d.integer(rf[tokensKey], join(p, tokensKey)); err != nil {
			return t, err
		}
		if r.MaxTokens <= 0 {
			return t, d.errAt(resolve(rf[tokensKey]), join(p, tokensKey), "token count must be positive")
		}
		for j, o := range t.Rows {
			if o.DType == r.DType && o.Hidden == r.Hidden && o.World == r.World && o.Algo == r.Algo && o.Out == r.Out {
				return t, d.errNoValue(resolve(it), p, "duplicate row: rows[%d] has the same dtype, hidden, world_size, algorithm and out", j)
			}
		}
		t.Rows = append(t.Rows, r)
	}
	return t, nil
}

// rowAxes reads the dtype, hidden and world_size fields of the measured row at path p.
func (d *doc) rowAxes(f map[string]*yaml.Node, p string) (RowAxes, error) {
	var r RowAxes
	name, err := d.str(f["dtype"], join(p, "dtype"))
	if err != nil {
		return r, err
	}
	if r.DType = dtypeByName(name); r.DType == nil {
		return r, d.errAt(resolve(f["dtype"]), join(p, "dtype"), "unknown dtype (want one of %s)", strings.Join(dtypeNames(), ", "))
	}
	if r.Hidden, err = d.integer(f["hidden"], join(p, "hidden")); err != nil {
		return r, err
	}
	r.HiddenAt = d.where(f["hidden"], join(p, "hidden"))
	if r.World, err = d.integer(f["world_size"], join(p, "world_size")); err != nil {
		return r, err
	}
	if !slices.Contains(worldSizes, r.World) {
		return r, d.errAt(resolve(f["world_size"]), join(p, "world_size"), "unsupported world size (want one of %s)", intsText(worldSizes))
	}
	r.WorldAt = d.where(f["world_size"], join(p, "world_size"))
	return r, nil
}

// tuningText reads a header field: free text, so any plain scalar is taken as written (an
// all-digit commit such as 0123456 or a date is not a string to YAML).
func (d *doc) tuningText(n *yaml.Node, path string) (string, error) {
	r := resolve(n)
	if r.Kind != yaml.ScalarNode || r.Tag == "!!null" {
		return "", d.errAt(r, path, "want a string, got %s", kindName(r))
	}
	// Printed into a C++ // comment: one line, and no trailing backslash (a line continuation).
	if strings.IndexFunc(r.Value, func(c rune) bool { return !unicode.IsPrint(c) }) >= 0 || strings.HasSuffix(r.Value, `\`) {
		return "", d.errAt(r, path, "want one line of printable text, not ending in a backslash")
	}
	return r.Value, nil
}

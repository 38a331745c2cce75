package pluginconfig

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strconv"
	"strings"
)

// FieldError is a problem at one place of a config file.
type FieldError struct {
	// Path is the field's path, e.g. "containers[0].command.shell"; empty
	// for the document as a whole.
	Path string
	// Problem says what was expected.
	Problem string
}

func (e *FieldError) Error() string {
	if e.Path == "" {
		return e.Problem
	}
	return e.Path + ": " + e.Problem
}

func fieldErr(path, format string, args ...any) *FieldError {
	return &FieldError{Path: path, Problem: fmt.Sprintf(format, args...)}
}

// decodeStrict decodes one JSON object into *PluginInfo. Unlike
// encoding/json it names the exact field of every problem, with array
// indices, rejects unknown fields with a suggestion and duplicate keys,
// and never quotes the file's bytes in a syntax error, only their place.
func decodeStrict(data []byte, out *PluginInfo) error {
	// Syntax first, over the whole file: the scanner of Unmarshal gives
	// true offsets (a Decoder's are relative to the value it was reading).
	if err := json.Unmarshal(data, new(json.RawMessage)); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return syntaxErr(data, se)
		}
		return fmt.Errorf("checking JSON: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	doc, err := readTree(dec, "")
	if err != nil {
		return err
	}
	if err := checkValue(doc, reflect.TypeFor[PluginInfo](), ""); err != nil {
		return err
	}
	// checkValue proved the document fits the type, so this cannot fail
	// but for a bug; report it rather than hide it.
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("decoding checked config: %w", err)
	}
	return nil
}

// readTree reads the next value of dec (UseNumber), syntactically valid
// JSON, into the form Decode gives an any, refusing a key twice in one
// object (encoding/json would silently keep the last). path is the
// value's field path.
func readTree(dec *json.Decoder, path string) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("reading checked JSON: %w", err)
	}
	switch tok {
	case json.Delim('{'):
		obj := map[string]any{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return nil, fmt.Errorf("reading checked JSON: %w", err)
			}
			key, _ := kt.(string) // the scanner proved it is one
			if _, dup := obj[key]; dup {
				return nil, fieldErr(path, "duplicate key %q", key)
			}
			sub := key
			if path != "" {
				sub = path + "." + key
			}
			if obj[key], err = readTree(dec, sub); err != nil {
				return nil, err
			}
		}
		_, err = dec.Token() // '}'
		return obj, err
	case json.Delim('['):
		arr := []any{}
		for i := 0; dec.More(); i++ {
			v, err := readTree(dec, fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			arr = append(arr, v)
		}
		_, err = dec.Token() // ']'
		return arr, err
	}
	return tok, nil
}

// syntaxErr describes a JSON syntax error by its place: byte offset, line
// and column. encoding/json's own text quotes the offending byte
// ("invalid character 'r' looking for beginning of value"), which would
// hand the first byte of whatever file a symlink reaches to whoever sees
// the error; it is rewritten from a list of the scanner's contexts.
func syntaxErr(data []byte, se *json.SyntaxError) error {
	msg := se.Error()
	switch {
	case len(bytes.TrimSpace(data)) == 0:
		return fieldErr("", "not valid JSON: the file is empty")
	case msg == "unexpected end of JSON input":
		return fieldErr("", "not valid JSON: unexpected end of file")
	}
	// The scanner counts the offending byte in Offset.
	at := place(data, se.Offset-1)
	for _, c := range syntaxContexts {
		if strings.Contains(msg, c.context) {
			return fieldErr("", c.problem, at)
		}
	}
	return fieldErr("", "not valid JSON at %s", at)
}

// syntaxContexts translates encoding/json's syntax errors ("invalid
// character 'c' ..." and the like) by their context, the first that the
// message contains (longer contexts before their prefixes).
var syntaxContexts = []struct{ context, problem string }{
	{" after top-level value", "more than one JSON value: text after the first at %s; a config file holds one CSIPluginInfo object"},
	{" looking for beginning of value", "not valid JSON: expected a value at %s"},
	{" looking for beginning of object key string", "not valid JSON: expected an object key (a string in double quotes) at %s"},
	{" after object key:value pair", "not valid JSON: expected ',' or '}' after an object member at %s"},
	{" after object key", "not valid JSON: expected ':' after an object key at %s"},
	{" after array element", "not valid JSON: expected ',' or ']' after an array element at %s"},
	{" in string literal", "not valid JSON: control character in a string (escape it) at %s"},
	{" in string escape code", "not valid JSON: invalid escape in a string at %s"},
	{" hexadecimal character escape", "not valid JSON: invalid \\u escape in a string at %s"},
	{" numeric literal", "not valid JSON: invalid number at %s"},
	{" in literal ", "not valid JSON: invalid literal (expected true, false or null) at %s"},
	{"exceeded max depth", "not valid JSON: nested too deeply at %s"},
}

// place is "byte offset N (line L, column C)" for a 0-based offset.
func place(data []byte, offset int64) string {
	offset = max(0, min(offset, int64(len(data))))
	before := data[:offset]
	line := bytes.Count(before, []byte("\n")) + 1
	col := int(offset) - bytes.LastIndexByte(before, '\n')
	return fmt.Sprintf("byte offset %d (line %d, column %d)", offset, line, col)
}

// checkValue checks that v (decoded with UseNumber) fits type t.
func checkValue(v any, t reflect.Type, path string) error {
	if v == nil {
		return nil // null leaves a field at its zero value, as encoding/json does
	}
	if reflect.PointerTo(t).Implements(reflect.TypeFor[json.Unmarshaler]()) {
		if t == reflect.TypeFor[json.RawMessage]() {
			return nil
		}
		raw, err := json.Marshal(v)
		if err != nil {
			return fieldErr(path, "%v", err)
		}
		if err := reflect.New(t).Interface().(json.Unmarshaler).UnmarshalJSON(raw); err != nil {
			return fieldErr(path, "%v", err)
		}
		return nil
	}
	switch t.Kind() {
	case reflect.Pointer:
		return checkValue(v, t.Elem(), path)
	case reflect.Struct:
		obj, ok := v.(map[string]any)
		if !ok {
			return fieldErr(path, "expected an object, got %s", describe(v))
		}
		return checkObject(obj, t, path)
	case reflect.Slice:
		arr, ok := v.([]any)
		if !ok {
			return fieldErr(path, "expected an array, got %s", describe(v))
		}
		for i, e := range arr {
			if err := checkValue(e, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		return nil
	case reflect.String:
		if _, ok := v.(string); !ok {
			return fieldErr(path, "expected a string, got %s", describe(v))
		}
		return nil
	case reflect.Bool:
		if _, ok := v.(bool); !ok {
			return fieldErr(path, "expected true or false, got %s", describe(v))
		}
		return nil
	case reflect.Int:
		n, ok := v.(json.Number)
		if !ok {
			return fieldErr(path, "expected an integer, got %s", describe(v))
		}
		if _, err := n.Int64(); err != nil {
			return fieldErr(path, "expected an integer, got %s", n)
		}
		return nil
	case reflect.Uint64:
		n, ok := v.(json.Number)
		if !ok {
			return fieldErr(path, "expected a non-negative integer, got %s", describe(v))
		}
		if _, err := strconv.ParseUint(n.String(), 10, 64); err != nil {
			if errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(n.String(), "-") {
				return fieldErr(path, "%s is out of range (at most %d)", n, uint64(math.MaxUint64))
			}
			return fieldErr(path, "expected a non-negative integer, got %s", n)
		}
		return nil
	case reflect.Float64:
		n, ok := v.(json.Number)
		if !ok {
			return fieldErr(path, "expected a number, got %s", describe(v))
		}
		if _, err := n.Float64(); err != nil {
			// JSON has no NaN or Inf; a huge number is where they come from.
			return fieldErr(path, "%s is out of range for a number", n)
		}
		return nil
	}
	return fieldErr(path, "internal error: no check for Go type %s", t)
}

func checkObject(obj map[string]any, t reflect.Type, path string) error {
	fields := jsonFields(t)
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		sub := k
		if path != "" {
			sub = path + "." + k
		}
		ft, ok := fields[k]
		if !ok {
			return fieldErr(sub, "unknown field%s", suggestion(k, fields))
		}
		if err := checkValue(obj[k], ft, sub); err != nil {
			return err
		}
	}
	return nil
}

// jsonFields maps a struct's JSON names to their types.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := make(map[string]reflect.Type, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		out[name] = f.Type
	}
	return out
}

// suggestion names the known field closest to a misspelt one.
func suggestion(k string, fields map[string]reflect.Type) string {
	best, bestDist := "", 3 // suggest only near misses
	for name := range fields {
		if d := editDistance(strings.ToLower(k), name); d < bestDist || (d == bestDist && name < best) {
			best, bestDist = name, d
		}
	}
	if best == "" {
		names := make([]string, 0, len(fields))
		for name := range fields {
			names = append(names, name)
		}
		sort.Strings(names)
		return "; known fields: " + strings.Join(names, ", ")
	}
	return fmt.Sprintf("; did you mean %q?", best)
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func describe(v any) string {
	switch x := v.(type) {
	case string:
		if len(x) > 40 {
			x = x[:40] + "…"
		}
		return fmt.Sprintf("string %q", x)
	case bool:
		return fmt.Sprintf("boolean %v", x)
	case json.Number:
		return "number " + x.String()
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}

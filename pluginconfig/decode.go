package pluginconfig

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sort"
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
// indices, and rejects unknown fields with a suggestion.
func decodeStrict(data []byte, out *PluginInfo) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var doc any
	if err := dec.Decode(&doc); err != nil {
		return fieldErr("", "not valid JSON: %s", jsonSyntaxProblem(data, err))
	}
	if _, err := dec.Token(); err == nil {
		return fieldErr("", "more than one JSON value; a config file holds one CSIPluginInfo object")
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

// jsonSyntaxProblem turns a decoder error into "<what> at line L, column C".
func jsonSyntaxProblem(data []byte, err error) string {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		line, col := position(data, se.Offset)
		return fmt.Sprintf("%s at line %d, column %d", strings.TrimPrefix(se.Error(), "json: "), line, col)
	}
	if errors.Is(err, io.EOF) {
		return "the file is empty"
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return "unexpected end of file"
	}
	return err.Error()
}

func position(data []byte, offset int64) (line, col int) {
	if offset > int64(len(data)) {
		offset = int64(len(data))
	}
	before := data[:offset]
	line = bytes.Count(before, []byte("\n")) + 1
	col = int(offset) - bytes.LastIndexByte(before, '\n') - 1
	if col < 1 {
		col = 1
	}
	return line, col
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
	case reflect.Float64:
		n, ok := v.(json.Number)
		if !ok {
			return fieldErr(path, "expected a number, got %s", describe(v))
		}
		if _, err := n.Float64(); err != nil {
			return fieldErr(path, "expected a number, got %s", n)
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

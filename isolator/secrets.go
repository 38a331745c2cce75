package isolator

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// resolveSecrets turns Mesos secrets into the CSI secrets map: VALUE
// secrets as given; REFERENCE secrets read from --secrets-dir, where name
// is a file holding a JSON object and key one of its keys. Errors name the
// secret, never its value.
func (iso *Isolator) resolveSecrets(in map[string]*statev1.Secret) (map[string]string, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(in))
	for k, s := range in {
		switch s.GetType() {
		case statev1.Secret_VALUE:
			out[k] = string(s.GetValue().GetData())
		case statev1.Secret_REFERENCE:
			v, err := iso.readReference(s.GetReference())
			if err != nil {
				return nil, fmt.Errorf("%w: secret %q: %w", ErrInvalid, k, err)
			}
			out[k] = v
		default:
			return nil, fmt.Errorf("%w: secret %q: type must be VALUE or REFERENCE", ErrInvalid, k)
		}
	}
	return out, nil
}

func (iso *Isolator) readReference(ref *statev1.Secret_Reference) (string, error) {
	name, key := ref.GetName(), ref.GetKey()
	if iso.cfg.SecretsDir == "" {
		return "", fmt.Errorf("reference %q: the agent has no --secrets-dir", name)
	}
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return "", fmt.Errorf("reference name %q must be a file name in the secrets dir", name)
	}
	b, err := os.ReadFile(filepath.Join(iso.cfg.SecretsDir, name))
	if err != nil {
		return "", fmt.Errorf("reference %q: %w", name, err)
	}
	var obj map[string]string
	if err := json.Unmarshal(b, &obj); err != nil {
		// Never include the content: it is a secret.
		return "", fmt.Errorf("reference %q: the file is not a JSON object of strings", name)
	}
	v, ok := obj[key]
	if !ok {
		return "", fmt.Errorf("reference %q has no key %q", name, key)
	}
	return v, nil
}

// checkSecrets resolves a request's secrets up front, so that a missing
// reference fails the request before anything is done: the attach's too,
// whose intent, once recorded, is undone with the same secrets.
func (iso *Isolator) checkSecrets(pm plannedMount) error {
	for what, m := range map[string]map[string]*statev1.Secret{
		"node_stage_secrets":         pm.static.GetNodeStageSecrets(),
		"node_publish_secrets":       pm.static.GetNodePublishSecrets(),
		"controller_publish_secrets": pm.static.GetControllerPublishSecrets(),
	} {
		if _, err := iso.resolveSecrets(m); err != nil {
			return fmt.Errorf("volume %s: %s: %w", pm.key, what, err)
		}
	}
	return nil
}

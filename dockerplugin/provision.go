package dockerplugin

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/csiagent/csiagent/namedvol"
)

// provision defines d and creates its backend volume (name lock held):
//
//  1. the intent: d in state creating, durable, before any call;
//  2. Backend.CreateVolume with d's CSI name (namedvol.CSIName, fixed with
//     the intent): the plugin
//     finds a volume it made under that name again, so a crash anywhere
//     here, and the repeated create that follows, never makes a second;
//  3. the answer (id, context, topology) recorded, durable.
//
// The same request for a name already created is no change; another one
// is namedvol.ErrExists. A failed CreateVolume leaves the intent, for a
// repeated create to finish, unless it made nothing
// (namedvol.ErrNotCreated) and the intent is this call's: then the
// intent goes with the error.
func (s *Server) provision(ctx context.Context, d *namedvol.Definition, secrets map[string]string) error {
	fresh := false // the intent is this call's
	old, err := s.cfg.Store.Get(d.Name)
	switch {
	case err == nil && !old.SameRequest(d):
		return fmt.Errorf("%w: %s (remove it first)", namedvol.ErrExists, d.Name)
	case err == nil && !old.Creating():
		// Created already, by a call whose wait may have ended first.
		return s.cfg.Store.Sync(ctx)
	case err == nil:
		d.Creator, d.Provision.CSIName = old.Creator, old.Provision.CSIName
	case !errors.Is(err, namedvol.ErrNotFound):
		return err
	default:
		fresh = true
		nonce := make([]byte, 8)
		if _, err := rand.Read(nonce); err != nil {
			return fmt.Errorf("volume %s: %w", d.Name, err)
		}
		d.Provision.State, d.Provision.CSIName = namedvol.ProvisionCreating, namedvol.CSIName(d.Name, s.cfg.NodeID, hex.EncodeToString(nonce))
		if err := s.cfg.Store.Create(ctx, d); err != nil {
			return err
		}
		s.crashPoint("named volume creating")
	}
	d.Provision.State = namedvol.ProvisionCreating
	s.log.Info("creating volume", "name", d.Name, "plugin", d.Plugin, "csi_name", d.Provision.CSIName, "size", d.Provision.Size)
	if err := s.cfg.Backend.CreateVolume(ctx, d, secrets); err != nil {
		if fresh && errors.Is(err, namedvol.ErrNotCreated) {
			// Nothing made, by this call's intent alone: the intent
			// goes, and the name is free again (kept, it could be
			// neither finished nor removed).
			if rerr := s.cfg.Store.Remove(ctx, d.Name); rerr != nil {
				s.log.Error("dropping the intent of a creation that made nothing", "name", d.Name, "error", rerr)
			}
		}
		return fmt.Errorf("volume %s: %w", d.Name, err)
	}
	s.crashPoint("rpc CreateVolume")
	if err := s.cfg.Store.Replace(ctx, d); err != nil {
		return err
	}
	s.crashPoint("named volume created")
	s.log.Info("named volume created", "name", d.Name, "plugin", d.Plugin, "volume_id", d.VolumeID, "creator", d.Creator)
	return nil
}

func (s *Server) crashPoint(point string) {
	if s.cfg.CrashPoint != nil {
		s.cfg.CrashPoint(point)
	}
}

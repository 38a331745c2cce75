// Package pluginconfig reads and watches a directory of Mesos CSIPluginInfo
// JSON files, one plugin per file, as the Mesos agent's
// --csi_plugin_config_dir does.
//
// Contract:
//   - Parse decodes one file strictly: Mesos field names, enums as names,
//     unknown fields rejected (with a "did you mean" hint) except the one
//     key SettingsKey for csiagent's own per-plugin settings. Every error
//     names the field path and what was expected. Defaults are filled in
//     (name "default", command.shell true) and endpoints normalised to
//     unix:// URIs.
//   - Load returns every valid plugin plus one error per bad file. A bad
//     file never keeps another out; an empty directory is a valid, empty
//     set. Its own error is only for a directory that cannot be read.
//   - Watch turns directory changes into per-plugin Added / Changed /
//     Removed / Invalid events, debounced, and keeps a plugin's last good
//     config in force while its file is invalid.
//
// When not to use it: the agent consumes Watch; one-off tools (check-config,
// tests) use Load. Neither starts plugins or touches anything outside the
// directory.
package pluginconfig

// Package pluginconfig reads and watches a directory of Mesos CSIPluginInfo
// JSON files, one plugin per file, as the Mesos agent's
// --csi_plugin_config_dir does.
//
// Contract:
//   - Parse decodes one file strictly: Mesos field names, enums as names,
//     unknown fields rejected (with a "did you mean" hint) except the one
//     key SettingsKey for csiagent's own per-plugin settings, a key given
//     twice in any object rejected, resource amounts never negative or out
//     of range. Every error names the field path and what was expected; a
//     syntax error gives its byte offset, line and column, and never quotes
//     the file's bytes (a config may be a symlink to anything). Defaults are
//     filled in (name "default", command.shell true) and endpoints
//     normalised to unix:// URIs.
//   - Load and LoadContext return every valid plugin plus one error per
//     bad file. Symlinks are followed, but each entry must reach a regular
//     file of at most 1 MiB: a FIFO, device, socket, dangling symlink or
//     directory named *.json is a bad file (other directories, names
//     starting with '.', and editors' "name~" backups and "#name#"
//     autosaves are skipped). Two files of one type: the first by name
//     keeps it, as the Mesos agent keeps the first it reads. Files are opened non-blocking and
//     checked with fstat before any read, so no entry can block the load;
//     a read that hangs anyway (a stuck file system) is given up after 5s,
//     and LoadContext stops at once when its context ends. A bad file never
//     keeps another out; an empty directory is a valid, empty set. Their
//     own error is only for a directory that cannot be read, or an ended
//     context.
//   - Watch turns directory changes into per-plugin Added / Changed /
//     Removed / Invalid events, debounced, and keeps a plugin's last good
//     config in force while its file is invalid, whatever made it so (its
//     type stays its file's: no other file defining it takes over). An
//     Update also goes out when only the list of bad files changed. The
//     directory's replacement (renamed over, made again, a symlink to it
//     swapped) is seen through a watch on its parent, and a check every
//     10 s (WatchConfig.CheckInterval), which also finds a watch the
//     kernel ended unseen; the new directory is watched from then on.
//
// When not to use it: the agent consumes Watch; one-off tools (check-config,
// tests) use LoadContext. Neither starts plugins or touches anything
// outside the directory, and neither reads from a device, FIFO or socket.
package pluginconfig

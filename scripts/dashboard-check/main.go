// dashboard-check FILE: reads a Grafana dashboard JSON with the Grafana Foundation SDK's dashboard
// kind (types generated from Grafana's own dashboard schema) strictly, as the SDK's
// UnmarshalJSONStrict does: an unknown field, a value of the wrong type or a missing required
// field is an error, and so is a panel's options or query that does not fit its panel or data
// source plugin. Then the schema's constraints (Validate: gridPos inside the 24 columns, ...).
// Prints "ok", or one line per error and exits 1; 2 for a file it cannot read.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dashboard-check FILE")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "dashboard-check: %v\n", err)
		os.Exit(2)
	}
	plugins.RegisterDefaultPlugins() // the panel and data source kinds, for options and targets
	var strict, board dashboard.Dashboard
	found := problems(strict.UnmarshalJSONStrict(raw))
	if len(found) == 0 {
		// The constraints, on the dashboard as the plain unmarshalling fills it: the strict one
		// leaves every panel out of its result (PanelOrRowPanel takes the empty error list a
		// panel's strict unmarshalling returns for a failure), so its Validate would see none.
		if err := json.Unmarshal(raw, &board); err != nil {
			found = []string{err.Error()}
		} else {
			found = problems(board.Validate())
		}
	}
	if len(found) > 0 {
		for _, line := range found {
			fmt.Println(line)
		}
		os.Exit(1)
	}
	fmt.Println("ok")
}

// problems is one line per error; none for a nil error or an empty cog.BuildErrors (which the
// SDK's strict unmarshalling returns, as an error value, when it found nothing).
func problems(err error) []string {
	var all cog.BuildErrors
	if errors.As(err, &all) {
		lines := make([]string, len(all))
		for i, one := range all {
			lines[i] = one.Error()
		}
		return lines
	}
	if err != nil {
		return []string{err.Error()}
	}
	return nil
}

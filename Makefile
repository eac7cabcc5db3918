# convoy: the two commands
#   make test   installs what is missing (Debian packages), then runs EUnit + PropEr,
#               Common Test (peer nodes), Dialyzer, xref, the Elixir example and
#               the Phoenix.PubSub adapter's tests.
#   make bench  runs the seed comparison on nodes it starts itself (ARGS="--help").

REBAR ?= rebar3
ARGS ?=
DEBIAN_PKGS = rebar3 erlang-common-test erlang-dialyzer erlang-proper-dev gnuplot-nox elixir
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps compile test eunit ct dialyzer xref elixir phoenix phoenix-build manifold-build \
  bench docs clean

all: compile

# Install the Debian packages that are missing (apt-get update first).
deps:
	@missing=""; \
	for p in $(DEBIAN_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

compile: deps
	$(REBAR) compile

test: deps
	$(REBAR) eunit
	$(REBAR) ct --sname convoy_ct
	$(REBAR) dialyzer
	$(REBAR) xref
	$(MAKE) elixir
	$(MAKE) phoenix

eunit: deps
	$(REBAR) eunit

ct: deps
	$(REBAR) ct --sname convoy_ct

dialyzer: deps
	$(REBAR) dialyzer

xref: deps
	$(REBAR) xref

# The Elixir example: a mix project that depends on convoy by path.
elixir: deps
	@command -v mix >/dev/null || { echo "mix not found: install Elixir (apt-get install elixir)"; exit 1; }
	cd examples/elixir_demo && MIX_ENV=test MIX_HOME="$$PWD/_build/mix" HEX_OFFLINE=1 \
	  MIX_REBAR3="$$(command -v $(REBAR))" REBAR_BASE_DIR="$$PWD/_build/rebar3" \
	  mix test </dev/null 2>&1

# The Phoenix.PubSub adapter, integrations/phoenix_pubsub_convoy: phoenix_pubsub's
# own adapter suite and multi-node tests. phoenix_pubsub is the copy in
# shared/vendor beside this repository when it is there (set PHOENIX_PUBSUB_PATH
# to use another checkout of it), else it is fetched from Hex; the step says which.
PHOENIX_PUBSUB_PATH ?= $(abspath $(CURDIR)/../shared/vendor/phoenix_pubsub)
PHOENIX_ENV = MIX_ENV=test MIX_HOME="$$PWD/_build/mix" \
  MIX_REBAR3="$$(command -v $(REBAR))" REBAR_BASE_DIR="$$PWD/_build/rebar3"

phoenix: deps
	@command -v mix >/dev/null || { echo "mix not found: install Elixir (apt-get install elixir)"; exit 1; }
	@cd integrations/phoenix_pubsub_convoy && \
	if test -f "$(PHOENIX_PUBSUB_PATH)/mix.exs"; then \
	  echo "phoenix_pubsub: the copy at $(PHOENIX_PUBSUB_PATH)"; \
	  $(PHOENIX_ENV) HEX_OFFLINE=1 PHOENIX_PUBSUB_PATH="$(PHOENIX_PUBSUB_PATH)" mix test </dev/null 2>&1; \
	else \
	  echo "phoenix_pubsub: no copy at $(PHOENIX_PUBSUB_PATH), from Hex"; \
	  { $(PHOENIX_ENV) mix local.hex --force --if-missing >/dev/null 2>&1 && \
	    $(PHOENIX_ENV) PHOENIX_PUBSUB_PATH= mix deps.get </dev/null >/dev/null 2>&1; } || \
	  { echo "phoenix_pubsub: neither a copy at PHOENIX_PUBSUB_PATH ($(PHOENIX_PUBSUB_PATH)) nor Hex (unreachable): set PHOENIX_PUBSUB_PATH to a checkout of phoenix_pubsub 2.x"; exit 1; }; \
	  $(PHOENIX_ENV) PHOENIX_PUBSUB_PATH= mix test </dev/null 2>&1; \
	fi

# The same build without the tests: phoenix_pubsub and the adapter compiled into
# integrations/phoenix_pubsub_convoy/_build/test/lib/*/ebin, where the bench
# scenario `pubsub` loads them from (a second or two once built).
phoenix-build:
	@command -v mix >/dev/null || { echo "mix not found: install Elixir (apt-get install elixir)"; exit 1; }
	@test -f "$(PHOENIX_PUBSUB_PATH)/mix.exs" || { echo "phoenix_pubsub not found at $(PHOENIX_PUBSUB_PATH): set PHOENIX_PUBSUB_PATH"; exit 1; }
	cd integrations/phoenix_pubsub_convoy && MIX_ENV=test MIX_HOME="$$PWD/_build/mix" HEX_OFFLINE=1 \
	  MIX_REBAR3="$$(command -v $(REBAR))" REBAR_BASE_DIR="$$PWD/_build/rebar3" \
	  PHOENIX_PUBSUB_PATH="$(PHOENIX_PUBSUB_PATH)" mix compile </dev/null 2>&1

# discord/manifold, for the bench's `manifold` variant (fanout): compiled with
# elixirc, without Mix, into _build/manifold/ebin with a manifold.app beside the
# beams (rebuilt when a source is newer). MANIFOLD_PATH is the copy in shared/vendor
# beside this repository (read-only: nothing is written there).
MANIFOLD_PATH ?= $(abspath $(CURDIR)/../shared/vendor/manifold)
MANIFOLD_EBIN = _build/manifold/ebin
MANIFOLD_SRC = $(wildcard $(MANIFOLD_PATH)/lib/manifold.ex $(MANIFOLD_PATH)/lib/manifold/*.ex)

manifold-build:
	@command -v elixirc >/dev/null || { echo "elixirc not found: install Elixir (apt-get install elixir)"; exit 1; }
	@test -f "$(MANIFOLD_PATH)/lib/manifold.ex" || { echo "manifold not found at $(MANIFOLD_PATH): set MANIFOLD_PATH"; exit 1; }
	@$(MAKE) --no-print-directory $(MANIFOLD_EBIN)/manifold.app

$(MANIFOLD_EBIN)/manifold.app: $(MANIFOLD_SRC) $(MANIFOLD_PATH)/mix.exs
	rm -rf $(MANIFOLD_EBIN) && mkdir -p $(MANIFOLD_EBIN)
	elixirc -o $(MANIFOLD_EBIN) $(MANIFOLD_SRC) </dev/null 2>&1
	@vsn=$$(sed -n 's/^ *version: "\(.*\)",*$$/\1/p' "$(MANIFOLD_PATH)/mix.exs"); \
	mods=$$(cd $(MANIFOLD_EBIN) && ls *.beam | sed "s/\.beam$$//; s/.*/'&'/" | paste -sd, -); \
	printf '%s\n' "{application,manifold,[{description,\"discord/manifold, built by make manifold-build\"},{vsn,\"$$vsn\"},{modules,[$$mods]},{registered,[]},{applications,[kernel,stdlib,elixir,logger]},{mod,{'Elixir.Manifold',[]}}]}." > $@
	@echo "manifold: built in $(MANIFOLD_EBIN)"

# The pubsub scenario needs phoenix-build and the fanout scenario's manifold
# variant manifold-build: built here when Elixir and their sources are at hand;
# without them the scenario (pubsub) or the variant (manifold) is skipped with a note.
bench: deps
	$(REBAR) as bench compile
	@if command -v mix >/dev/null && test -f "$(PHOENIX_PUBSUB_PATH)/mix.exs"; then \
	  $(MAKE) --no-print-directory phoenix-build >/dev/null || echo "phoenix-build failed: the pubsub scenario will be skipped"; fi
	@if command -v elixirc >/dev/null && test -f "$(MANIFOLD_PATH)/lib/manifold.ex"; then \
	  $(MAKE) --no-print-directory manifold-build >/dev/null || echo "manifold-build failed: the manifold variant will be skipped"; \
	else echo "manifold: not built (no elixirc, or no copy at $(MANIFOLD_PATH)): the manifold variant will be skipped"; fi
	bin/convoy-bench $(ARGS)

# HTML of the public modules (convoy, convoy_channel, convoy_config's settings/0)
# with doc/overview.edoc as front page, in doc/api/ (not committed): open
# doc/api/index.html. Rebuilt from scratch each time.
docs: deps
	rm -rf doc/api
	$(REBAR) edoc
	@echo "docs: $(CURDIR)/doc/api/index.html"

clean:
	$(REBAR) clean -a
	rm -rf _build

defmodule PhoenixPubsubConvoy.MixProject do
  use Mix.Project

  def project do
    [
      app: :phoenix_pubsub_convoy,
      version: "0.2.0",
      elixir: "~> 1.14",
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: deps(),
      # test_helper.exs makes this node distributed and then starts the
      # applications: convoy must start on a node that already has its name.
      aliases: [test: "test --no-start"],
      description:
        "Phoenix.PubSub adapter whose broadcasts between nodes travel through " <>
          "convoy, batched per node; it speaks Phoenix.PubSub.PG2's protocol",
      package: package(),
      # For ex_doc, which is not a dependency here (see doc/releasing.md).
      docs: [main: "readme", extras: ["README.md"]]
    ]
  end

  # Hex metadata. `links` stays empty until the project has a public repository
  # URL (doc/releasing.md at the repository root).
  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{},
      files: ["lib", "mix.exs", ".formatter.exs", "README.md", "LICENSE"]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  # test/support holds the modules the peer nodes run (subscribers, a tracker):
  # compiled into this project's ebin, which the peers get with -pa.
  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  # convoy is this repository, compiled with rebar3 (set MIX_REBAR3), unless
  # CONVOY_PATH is set: to another checkout, or empty for the Hex package (what
  # `mix hex.publish` needs: a Hex package depends on Hex packages only).
  # phoenix_pubsub comes from Hex, unless PHOENIX_PUBSUB_PATH names a checkout of
  # it (`make phoenix` points it at the vendored copy beside the repository, for
  # machines without Hex). The version requirements hold either way.
  defp deps do
    [
      convoy(),
      phoenix_pubsub()
    ]
  end

  defp convoy do
    case System.get_env("CONVOY_PATH", "../..") do
      "" -> {:convoy, "~> 0.1"}
      path -> {:convoy, "~> 0.1", path: path, manager: :rebar3}
    end
  end

  defp phoenix_pubsub do
    case System.get_env("PHOENIX_PUBSUB_PATH", "") do
      "" -> {:phoenix_pubsub, "~> 2.1"}
      path -> {:phoenix_pubsub, "~> 2.1", path: path}
    end
  end
end

defmodule ElixirDemo.MixProject do
  use Mix.Project

  def project do
    [
      app: :elixir_demo,
      version: "0.1.0",
      elixir: "~> 1.14",
      deps: deps(),
      # test_helper.exs makes this node distributed and then starts the
      # applications: convoy must start on a node that already has its name.
      aliases: [test: "test --no-start"]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  # convoy is this repository: compiled with rebar3 (set MIX_REBAR3), no Hex.
  defp deps do
    [{:convoy, path: "../..", manager: :rebar3}]
  end
end

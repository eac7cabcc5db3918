%% The gen_server of the `cast' and `call' scenarios (on the sink node): answers
%% every call with `ok' and counts casts, telling the driver `{casts_done, Self}'
%% once it has the number it expects. Started by `convoy_bench_measure:gen_host/2'.
-module(convoy_bench_gen).

-behaviour(gen_server).

-export([init/1, handle_call/3, handle_cast/2]).

-type state() :: {Expected :: non_neg_integer(), Count :: non_neg_integer(), Driver :: pid()}.

-spec init({non_neg_integer(), pid()}) -> {ok, state()}.
init({Expected, Driver}) ->
    {ok, {Expected, 0, Driver}}.

-spec handle_call(term(), gen_server:from(), state()) -> {reply, ok, state()}.
handle_call(_Req, _From, S) ->
    {reply, ok, S}.

-spec handle_cast(term(), state()) -> {noreply, state()}.
handle_cast(_Req, {Expected, Count, Driver}) ->
    case Count + 1 of
        Expected -> Driver ! {casts_done, self()};
        _ -> ok
    end,
    {noreply, {Expected, Count + 1, Driver}}.

%% A gen_server for the Common Test suites of convoy:cast/2 and convoy:call/2,3,
%% and a tiny registry for `{via, convoy_ct_server, Name}' names (kept in
%% persistent_term on the node that resolves them, so that it can name a process
%% of a node that is gone, which global would forget).
%%
%% The server logs every cast and message it gets (`{cast, Req}', `{info, Msg}')
%% and the calls `{seq, _}', in arrival order; calls:
%% `{echo, X}' answers X; `log' answers the log; `{seq, X}' logs and answers ok;
%% `{late, Ms}' answers `late' after Ms and then tells the owner
%% `{replied, Server}'; `hold' never answers and tells the owner
%% `{holding, Server}'; `{stop, Reason}' stops with Reason without answering.
-module(convoy_ct_server).

-behaviour(gen_server).

-export([start/2, start/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).
%% via registry
-export([register_name/2, unregister_name/1, whereis_name/1, send/2]).

%% Start a server (not linked) owned by Owner, registered as Name
%% (`{local, _}', `{global, _}', ...) or not.
start(Name, Owner) ->
    gen_server:start(Name, ?MODULE, Owner, []).

start(Owner) ->
    gen_server:start(?MODULE, Owner, []).

init(Owner) ->
    {ok, #{owner => Owner, log => []}}.

handle_call({echo, X}, _From, S) ->
    {reply, X, S};
handle_call(log, _From, S = #{log := Log}) ->
    {reply, lists:reverse(Log), S};
handle_call({seq, _} = Req, _From, S = #{log := Log}) ->
    {reply, ok, S#{log := [{call, Req} | Log]}};
handle_call({late, Ms}, From, S) ->
    erlang:send_after(Ms, self(), {answer_late, From}),
    {noreply, S};
handle_call(hold, _From, S = #{owner := Owner}) ->
    Owner ! {holding, self()},
    {noreply, S};
handle_call({stop, Reason}, _From, S) ->
    {stop, Reason, S}.

handle_cast(Req, S = #{log := Log}) ->
    {noreply, S#{log := [{cast, Req} | Log]}}.

handle_info({answer_late, From}, S = #{owner := Owner}) ->
    gen_server:reply(From, late),
    Owner ! {replied, self()},
    {noreply, S};
handle_info(Msg, S = #{log := Log}) ->
    {noreply, S#{log := [{info, Msg} | Log]}}.

%%--------------------------------------------------------------------
%% via registry (this node only)

register_name(Name, Pid) ->
    persistent_term:put({?MODULE, Name}, Pid),
    yes.

unregister_name(Name) ->
    _ = persistent_term:erase({?MODULE, Name}),
    ok.

whereis_name(Name) ->
    persistent_term:get({?MODULE, Name}, undefined).

send(Name, Msg) ->
    case whereis_name(Name) of
        undefined -> exit({badarg, {Name, Msg}});
        Pid -> Pid ! Msg, Pid
    end.
